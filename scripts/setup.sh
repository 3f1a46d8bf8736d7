#!/usr/bin/env bash
# Idempotent set-up: Debian packages, npm tools for the contract check, and the project venv.
# Every step checks first and installs only what is missing, so a second run is quick. It says what it installs
# and how long each step took; -q prints only failures and the last line.
set -euo pipefail
cd "$(dirname "$0")/.."

QUIET=""
case "${1:-}" in
  -q|--quiet) QUIET=1 ;;
  "") ;;
  -h|--help) echo "usage: scripts/setup.sh [-q]   (PYTHON=… picks the interpreter of the venv)"; exit 0 ;;
  *) echo "setup: unknown argument '$1' (usage: scripts/setup.sh [-q])" >&2; exit 2 ;;
esac

say() { [ -n "$QUIET" ] || echo "setup: $*"; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }
# Run a step's command with its output shown, or hidden under -q (shown after all if it fails).
run() {
  if [ -z "$QUIET" ]; then "$@"; return; fi
  local log; log=$(mktemp); if "$@" >"$log" 2>&1; then rm -f "$log"; else local rc=$?; cat "$log" >&2; rm -f "$log"; return $rc; fi
}

# pip says what it fetches and installs; its hundred "already satisfied" lines say nothing new.
pip_run() {
  if [ -n "$QUIET" ]; then run .venv/bin/pip install -q --progress-bar off "$@"; return; fi
  .venv/bin/pip install --progress-bar off "$@" 2>&1 | grep --line-buffered -vE '^(Requirement already satisfied|Looking in|  )' || true
  return "${PIPESTATUS[0]}"
}

# The interpreter must be the version pyproject.toml asks for: checked before anything is installed, so an old
# one is refused in one line here rather than deep in pip.
PY=${PYTHON:-python3}
NEED=$(sed -n 's/^requires-python *= *">= *\([0-9.]*\)".*/\1/p' pyproject.toml)
check_python() {
  local have
  have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
    echo "setup: $PY does not run; gpuaas needs Python >= $NEED (pyproject.toml): install it or set PYTHON=" >&2; exit 1; }
  if [ "$(printf '%s\n%s\n' "$NEED" "$have" | sort -V | head -1)" != "$NEED" ]; then
    echo "setup: $PY is Python $have; gpuaas needs >= $NEED (pyproject.toml requires-python): set PYTHON= to a newer one" >&2
    exit 1
  fi
}
# Only a fresh machine's missing python3 waits for the Debian packages (which bring it) to be checked.
python_checked=""
if [ -n "${PYTHON:-}" ] || command -v "$PY" >/dev/null 2>&1; then check_python; python_checked=1; fi

# Checked from a fresh Debian (debootstrap --variant=minbase): nothing else is needed.
APT_PACKAGES=(
  make                                     # the Makefile's entry points (fresh Debian has none)
  ca-certificates                          # HTTPS to the Python and npm package registries
  python3 python3-venv python3-dev gcc     # the venv; libvirt-python compiles against Python.h and libvirt-dev
  libvirt-dev pkg-config                   # libvirt-python's build
  qemu-utils                               # qemu-img / qemu-io: images and simulated disks
  docker-registry                          # the OCI registry the dev stack pushes images to
  postgresql                               # initdb / pg_ctl for the dev stack's and the tests' clusters
  libxml2-utils e2fsprogs util-linux       # xmllint; mkfs.ext4; wipefs and blkid (wipe proofs)
  prometheus                               # promtool and prometheus: the alert rules checked and evaluated in the suite
  chromium chromium-driver                 # the ops console's browser test (Selenium drives headless chromium)
  # The lab (real slice hosts on this machine, tests/e2e/test_lab_slice.py, `make lab`): QEMU/TCG guests under a
  # libvirt daemon of the lab's own inside a network namespace, DHCP from dnsmasq, UEFI firmware, the Debian
  # base image built from packages with a GRUB EFI loader, unix-socket forwarders, SSH to the guests.
  qemu-system-x86 libvirt-daemon-system libvirt-clients dnsmasq-base dnsmasq-utils ovmf
  iproute2 iptables socat openssh-client mmdebstrap grub-efi-amd64-bin dosfstools mtools
  openssh-server                           # a private sshd on loopback: the slice terminal's test (tests/e2e)
  gpgv gnupg                               # image base lists: gpgv checks SHA256SUMS.gpg; gpg makes the tests' keys
  bubblewrap                               # the image customiser's sandbox (no host /dev, /sys or network)
)
# The system services those packages bring that nothing here uses: the stack starts its own Postgres and
# registry on loopback, and the tests their own Prometheus. Only the ones this run installs are switched off; one
# the machine had before is left.
UNUSED_UNITS=(postgresql:postgresql docker-registry:docker-registry prometheus:prometheus openssh-server:ssh)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node runs the official AsyncAPI parser; a Node already on PATH (e.g. from nodesource) is used as it is.
if ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  t=$(now)
  say "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  run $SUDO apt-get update -q
  # Nothing installed here may start as a system service (libvirtd, dnsmasq, postgresql, the registry): the
  # stack and the lab start their own, on loopback and inside their namespace. A policy-rc.d that refuses
  # every start does that on a sysv or systemd host alike; one the machine already has is left as it is.
  policy=/usr/sbin/policy-rc.d; made_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod 755 "$policy" && made_policy=1
  fi
  run $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
    || { [ -n "$made_policy" ] && $SUDO rm -f "$policy"; exit 1; }
  [ -n "$made_policy" ] && $SUDO rm -f "$policy"
  # policy-rc.d stops the start during the install, not the next boot: on systemd the units stay enabled, so
  # they are disabled (never stopped: they did not start).
  if [ -d /run/systemd/system ]; then
    for pair in "${UNUSED_UNITS[@]}"; do
      pkg=${pair%%:*}; unit=${pair#*:}
      if [[ " ${missing[*]} " == *" $pkg "* ]] && systemctl list-unit-files "$unit.service" >/dev/null 2>&1; then
        $SUDO systemctl disable -q "$unit.service" 2>/dev/null && say "disabled the system $unit service (unused)"
      fi
    done
  fi
  say "Debian packages installed in $(took "$t")"
fi
[ -n "$python_checked" ] || check_python

# The official AsyncAPI parser runs under node; it is installed locally to tools/asyncapi-check.
if command -v npm >/dev/null 2>&1; then
  if [ ! -d tools/asyncapi-check/node_modules/@asyncapi/parser ]; then
    t=$(now)
    say "installing @asyncapi/parser (npm, into tools/asyncapi-check)"
    (cd tools/asyncapi-check && run npm install --no-audit --no-fund ${QUIET:+--silent})
    say "@asyncapi/parser installed in $(took "$t")"
  fi
else
  echo "setup: npm is still missing after installing Debian's nodejs and npm" >&2
  exit 1
fi

# A venv without a working pip (an interrupted or failed creation) is made again.
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  t=$(now)
  say "creating .venv with $PY"
  "$PY" -m venv --clear .venv
  rm -f .venv/.installed-*
  say ".venv created in $(took "$t")"
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  t=$(now)
  say "installing Python packages: pip, then gpuaas with its dev extras (pyproject.toml changed or first run)"
  pip_run --upgrade pip
  pip_run -e '.[dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
  say "Python packages installed in $(took "$t")"
fi
echo "setup: ready"
