#!/bin/sh
# H200/IB host baseline, run at first boot from the curated image (maas-host-image-pipeline runbook).
# Packages are baked into the image, so this only converges and validates; each check is recorded, and a
# host without the hardware (the lab's VM) records what it lacks instead of pretending it converged.
set -u
STATE=/var/lib/gpuaas/site-bootstrap
mkdir -p "$STATE"
out="$STATE/h200-ib.validation"
: > "$out"
check() { if eval "$2" >/dev/null 2>&1; then echo "$1=ok" >> "$out"; else echo "$1=absent" >> "$out"; fi; }
check nvidia_smi "nvidia-smi -L"
check ib_devices "ls /sys/class/infiniband/*"
check ipoib_netplan "test -f /etc/netplan/60-ipoib.yaml"
check iommu_args "grep -qw intel_iommu=on /proc/cmdline"
date -u +%Y-%m-%dT%H:%M:%SZ > "$STATE/h200-ib.done"
