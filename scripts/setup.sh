#!/usr/bin/env bash
# Idempotent set-up: Debian packages, npm tools for the contract check, and the project venv.
# Every step checks first and installs only what is missing, so a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."

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
  # The lab (real slice hosts on this machine, tests/e2e/test_lab_slice.py, `make lab`): QEMU/TCG guests under a
  # libvirt daemon of the lab's own inside a network namespace, DHCP from dnsmasq, UEFI firmware, the Debian
  # base image built from packages with a GRUB EFI loader, unix-socket forwarders, SSH to the guests.
  qemu-system-x86 libvirt-daemon-system libvirt-clients dnsmasq-base ovmf
  iproute2 iptables socat openssh-client mmdebstrap grub-efi-amd64-bin dosfstools mtools
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node runs the official AsyncAPI parser; a Node already on PATH (e.g. from nodesource) is used as it is.
if ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  # Nothing installed here may start as a system service (libvirtd, dnsmasq, postgresql, the registry): the
  # stack and the lab start their own, on loopback and inside their namespace. A policy-rc.d that refuses
  # every start does that on a sysv or systemd host alike; one the machine already has is left as it is.
  policy=/usr/sbin/policy-rc.d; made_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod 755 "$policy" && made_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { [ -n "$made_policy" ] && $SUDO rm -f "$policy"; exit 1; }
  [ -n "$made_policy" ] && $SUDO rm -f "$policy"
fi

# The official AsyncAPI parser runs under node; it is installed locally to tools/asyncapi-check.
if command -v npm >/dev/null 2>&1; then
  if [ ! -d tools/asyncapi-check/node_modules/@asyncapi/parser ]; then
    echo "setup: installing @asyncapi/parser"
    (cd tools/asyncapi-check && npm install --no-audit --no-fund --silent >/dev/null)
  fi
else
  echo "setup: npm is still missing after installing Debian's nodejs and npm" >&2
  exit 1
fi

PY=${PYTHON:-python3}
# A venv without a working pip (an interrupted or failed creation) is made again.
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  echo "setup: creating .venv"
  "$PY" -m venv --clear .venv
  rm -f .venv/.installed-*
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo "setup: installing Python packages"
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi
echo "setup: ready"
