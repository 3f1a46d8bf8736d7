#!/usr/bin/env bash
# Writes the .env that docker-compose.yml reads its secrets from: a fresh random value for every variable of
# .env.example. Usage: scripts/compose-env.sh [FILE]   (default: .env next to docker-compose.yml)
# Safe to run again: a value the file already has is kept (the Postgres superuser password is fixed when the
# pg-data volume is created, and the other services hold theirs), and only a variable that is missing or empty
# gets a fresh one, so a variable added to .env.example since is filled in. Exits 0 when there was nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.env}

# n random bytes as 2n hex characters: valid in a URL's userinfo, a MAAS key part and an HTTP header alike.
hex() { od -An -v -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }
fresh() {
  case "$1" in
    GPUAAS_MAAS_API_KEY) echo "$(hex 9):$(hex 9):$(hex 16)" ;;  # MAAS's 18:18:32 shape
    *) hex 24 ;;
  esac
}

# The variables .env.example names, in its order.
wanted=()
while IFS= read -r line; do
  case "$line" in GPUAAS_*=*) wanted+=("${line%%=*}") ;; esac
done < .env.example

umask 077
tmp=$(mktemp "$out.XXXXXX")
trap 'rm -f "$tmp"' EXIT

if [ ! -e "$out" ]; then
  # A new file: .env.example's comments and order, every variable filled.
  while IFS= read -r line; do
    case "$line" in
      GPUAAS_*=*) printf '%s\n' "${line%%=*}=$(fresh "${line%%=*}")" ;;
      *) printf '%s\n' "$line" ;;
    esac
  done < .env.example > "$tmp"
  mv "$tmp" "$out"
  trap - EXIT
  echo "compose-env: wrote $out (mode 0600)" >&2
  exit 0
fi

# An existing file: every line kept as it is, but an empty GPUAAS_* assignment, which gets a fresh value; the
# variables it lacks are appended.
present=" "  # the names the file assigns, space-separated (no associative array: macOS ships bash 3)
filled=()
while IFS= read -r line || [ -n "$line" ]; do
  name=${line%%=*}
  name=${name#export }
  if [ "$name" != "$line" ] && [[ $name =~ ^GPUAAS_[A-Z0-9_]+$ ]]; then
    present+="$name "
    if [ -z "${line#*=}" ]; then
      line="$name=$(fresh "$name")"
      filled+=("$name")
    fi
  fi
  printf '%s\n' "$line"
done < "$out" > "$tmp"
for name in "${wanted[@]}"; do
  case "$present" in
    *" $name "*) ;;
    *) printf '%s\n' "$name=$(fresh "$name")" >> "$tmp"; filled+=("$name") ;;
  esac
done

if [ "${#filled[@]}" -eq 0 ]; then
  echo "compose-env: $out has every variable; kept as it is" >&2
  exit 0
fi
# The new file takes the old one's place whole (mode 0600), never half-written.
mv "$tmp" "$out"
trap - EXIT
echo "compose-env: kept the values of $out and filled in ${filled[*]} (mode 0600)" >&2
