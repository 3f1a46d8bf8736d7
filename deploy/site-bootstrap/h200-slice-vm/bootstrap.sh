#!/bin/sh
# Slice-capable H200 host: the h200-ib baseline first when it has not run (the runbook's convergence gap of
# 2026-04-26), then the slice checks. GPUAAS_SLICE_INSTALL_PACKAGES=0 on the prebaked image: nothing installed.
set -u
STATE=/var/lib/gpuaas/site-bootstrap
HERE=$(dirname "$0")
mkdir -p "$STATE"
[ -f "$STATE/h200-ib.done" ] || "$HERE/../h200-ib/bootstrap.sh"
out="$STATE/h200-slice-vm.validation"
: > "$out"
check() { if eval "$2" >/dev/null 2>&1; then echo "$1=ok" >> "$out"; else echo "$1=absent" >> "$out"; fi; }
check vfio "test -d /sys/bus/pci/drivers/vfio-pci"
check ovsbr0 "ip -br addr show ovsbr0 | grep -q 10.100.0.1/24"
check libvirtd "systemctl is-active --quiet libvirtd"
check iommu_args "grep -qw iommu=pt /proc/cmdline"
date -u +%Y-%m-%dT%H:%M:%SZ > "$STATE/h200-slice-vm.done"
