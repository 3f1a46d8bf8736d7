#!/usr/bin/env bash
# Capture a real GPU host's facts as test fixtures: what discovery, parity and partition placement read
# (nvidia-smi XML and text, topology matrix, lspci, the GPUs' sysfs attributes, Fabric Manager state).
# Read-only: changes nothing on the host. Usage: capture-gpu-host-facts.sh OUT_DIR
set -uo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out/sysfs"
run() { local name=$1; shift; timeout 60 "$@" >"$out/$name" 2>"$out/$name.err"; echo "$? $*" >>"$out/commands.txt"; }
run uname.txt uname -a
run os-release.txt cat /etc/os-release
run nvidia-smi-q.xml nvidia-smi -q -x
run nvidia-smi-q.txt nvidia-smi -q
run nvidia-smi-topo.txt nvidia-smi topo -m
run nvidia-smi-nvlink-status.txt nvidia-smi nvlink -s
run nvidia-smi-fabric.txt nvidia-smi -q -d FABRIC
run nvidia-smi-list.txt nvidia-smi -L
run lspci-tree.txt lspci -tv
run lspci-nn.txt lspci -nn
run lscpu.txt lscpu
run numactl.txt numactl -H
run nv-fabricmanager.txt nv-fabricmanager --version
for bdf in $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null); do
  dev=$(echo "$bdf" | tr 'A-F' 'a-f' | sed -E 's/^0000([0-9a-f]{4}):/\1:/; s/^([0-9a-f]{8}):/\1/' )
  dev=$(ls -d /sys/bus/pci/devices/*"${dev#*:}" 2>/dev/null | head -1)
  [ -n "$dev" ] || continue
  b=$(basename "$dev"); d="$out/sysfs/$b"; mkdir -p "$d"
  for a in vendor device subsystem_vendor subsystem_device class numa_node local_cpulist iommu_group \
           current_link_speed current_link_width max_link_speed max_link_width sriov_totalvfs reset_method; do
    [ -e "$dev/$a" ] && { [ -L "$dev/$a" ] && readlink "$dev/$a" >"$d/$a" || cat "$dev/$a" >"$d/$a" 2>/dev/null; }
  done
  [ -e "$dev/driver" ] && basename "$(readlink "$dev/driver")" >"$d/driver"
  readlink -f "$dev" >"$d/path"
  timeout 30 lspci -vvv -s "$b" >"$d/lspci-vvv.txt" 2>&1
done
ls /sys/kernel/iommu_groups 2>/dev/null | wc -l >"$out/iommu-group-count.txt"
find "$out" -name '*.err' -size 0 -delete
echo done
