#!/usr/bin/env bash
# Writes the .env that docker-compose.yml reads its secrets from, with fresh random values for every
# variable of .env.example. Usage: scripts/compose-env.sh [FILE]   (default: .env next to docker-compose.yml)
# An existing file is kept: the Postgres superuser password is fixed when the pg-data volume is created.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.env}
if [ -e "$out" ]; then
  echo "compose-env: $out exists; keeping it (delete it, and the volumes with \`docker compose down -v\`, to start over)" >&2
  exit 1
fi

# n random bytes as 2n hex characters: valid in a URL's userinfo, a MAAS key part and an HTTP header alike.
hex() { od -An -v -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }

umask 077
tmp=$(mktemp "$out.XXXXXX")
trap 'rm -f "$tmp"' EXIT
while IFS= read -r line; do
  case "$line" in
    GPUAAS_MAAS_API_KEY=*) echo "GPUAAS_MAAS_API_KEY=$(hex 9):$(hex 9):$(hex 16)" ;;  # MAAS's 18:18:32 shape
    GPUAAS_*=*) echo "${line%%=*}=$(hex 24)" ;;
    *) echo "$line" ;;
  esac
done < .env.example > "$tmp"
mv "$tmp" "$out"
trap - EXIT
echo "compose-env: wrote $out (mode 0600)" >&2
