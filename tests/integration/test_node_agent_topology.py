"""Discovery and parity on generated XE9680L host roots (real files, real symlinks, the host tools the fixture
provides run as real processes, wipefs on the disk stand-ins)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuaas_dev.sim.fixture_host import build_host_root, eui_for, xe9680l
from gpuaas_node_agent.adapters.discovery import discover
from gpuaas_node_agent.adapters.host import Host
from gpuaas_node_agent.adapters.parity import ParityChecker, format_lines
from gpuaas_node_agent.service_layer.device_binding import enter_slice_mode, leave_slice_mode

GPU_BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]


@pytest.fixture
async def lab(tmp_path: Path):
    root = build_host_root(tmp_path / "host", xe9680l("lab-01", disk_file_bytes=1 << 20))
    return root, await discover(Host.at(root), "lab-01")


async def test_gpus_are_found_through_relative_pci_symlinks(lab) -> None:
    root, report = lab
    entry = root / "sys/bus/pci/devices/0000:18:00.0"
    assert entry.is_symlink() and not os.readlink(entry).startswith("/")
    assert [g.pci_address for g in report.gpus] == [f"0000:{b}:00.0" for b in GPU_BUSES]
    first = report.gpus[0]
    assert (first.vendor_id, first.device_id, first.numa_node, first.driver) == ("10de", "2335", 0, "vfio-pci")
    assert first.iommu_group is not None
    assert len({g.iommu_group for g in report.gpus}) == 8
    assert [g.numa_node for g in report.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Two GPUs per PCIe switch: the upstream port above the downstream port.
    switches = [g.pcie_switch for g in report.gpus]
    assert len(set(switches)) == 4 and switches[0] == switches[1] != switches[2]


async def test_fabric_pfs_vfs_and_ib_ports(lab) -> None:
    _, report = lab
    by_addr = {f.pci_address: f for f in report.fabric}
    cx7 = by_addr["0000:29:00.0"]
    assert (cx7.role, cx7.device_id, cx7.sriov_totalvfs, cx7.sriov_numvfs) == ("pf", "1021", 16, 4)
    assert (cx7.ib_device, cx7.ib_port_state, cx7.link_layer) == ("mlx5_0", "4: ACTIVE", "InfiniBand")
    vf = by_addr["0000:29:00.1"]
    assert (vf.role, vf.physfn, vf.device_id, vf.driver) == ("vf", "0000:29:00.0", "101e", "vfio-pci")
    bf3 = by_addr["0000:bc:00.1"]
    assert (bf3.device_id, bf3.ib_port_state, bf3.link_layer, bf3.sriov_numvfs) == ("a2dc", "1: DOWN", "Ethernet", 0)
    # The BF3 SoC management function is a DMA controller, not a fabric device.
    assert "0000:bc:00.2" not in by_addr
    assert sum(f.role == "vf" for f in report.fabric) == 8 and len(report.fabric) == 12


async def test_nvme_inventory_skips_hidden_paths_and_flags_os_and_mounted_child(lab) -> None:
    root, report = lab
    hidden = [n for n in os.listdir(root / "sys/block") if "c" in n.removeprefix("nvme")]
    assert hidden, "the fixture must contain hidden multipath nodes"
    assert len(report.nvme) == 9
    assert all(d.kernel_name not in hidden for d in report.nvme)
    by_name = {d.kernel_name: d for d in report.nvme}
    os_disk = by_name["nvme4n1"]
    assert os_disk.is_os_disk and not os_disk.candidate and os_disk.excluded_reason == "is_os_disk"
    assert os_disk.mounted_children == ["nvme4n1p1", "nvme4n1p2"]
    share = by_name["nvme8n1"]
    # The parent itself is not mounted: only the child check catches it.
    assert not share.mounted and share.mounted_children == ["nvme8n1p1"]
    assert not share.candidate and share.excluded_reason == "child_mounted"
    for d in report.nvme:
        assert d.by_id and d.by_id.startswith("/dev/disk/by-id/nvme-eui.") and "-part" not in d.by_id
        assert d.signatures == []
        assert d.size_bytes > 0
    candidates = {d.by_id for d in report.nvme if d.candidate}
    assert len(candidates) == 7


async def test_candidate_slots_pair_numa_local_devices_deterministically(lab) -> None:
    root, report = lab
    slots = report.candidate_slots
    assert [s.gpu_pci_address for s in slots] == [f"0000:{b}:00.0" for b in GPU_BUSES]
    complete = [s for s in slots if s.complete]
    assert len(complete) == 7 and slots[7].missing == ["nvme"]
    usable = {d.by_id for d in report.nvme if d.candidate}
    assert {s.nvme_by_id for s in complete} == usable
    numa_of = {d.by_id: d.numa_node for d in report.nvme}
    assert all(numa_of[s.nvme_by_id] == s.numa_node for s in complete)
    assert [s.fabric_vf_pci_address for s in slots] == [f"0000:29:00.{i}" for i in range(1, 5)] + [
        f"0000:a9:00.{i}" for i in range(1, 5)
    ]
    assert [s.private_ip for s in slots] == [f"10.100.0.{10 + i}" for i in range(8)]
    assert [s.ovs_port for s in slots] == [f"gpuaas-s{i}" for i in range(8)]
    assert len({s.mac for s in slots}) == 8 and all(s.mac.startswith("52:54:00:") for s in slots)
    assert any("0000:db:00.0" in b for b in report.blockers)
    again = await discover(Host.at(root), "lab-01")
    assert [s.model_dump() for s in again.candidate_slots] == [s.model_dump() for s in slots]


async def test_by_id_identity_is_stable_when_kernel_names_move(tmp_path: Path) -> None:
    wwids = [eui_for("lab-02", i) for i in range(8)]
    before = await discover(
        Host.at(build_host_root(tmp_path / "a", xe9680l("lab-02", data_disk_wwids=wwids, disk_file_bytes=1 << 20))),
        "lab-02",
    )
    # After a reboot the BOSS disk came back as nvme7n1 (as on the lab host) and every other name shifted.
    after = await discover(
        Host.at(
            build_host_root(
                tmp_path / "b", xe9680l("lab-02", data_disk_wwids=wwids, os_disk_ctrl=7, disk_file_bytes=1 << 20)
            )
        ),
        "lab-02",
    )
    names_before = {d.by_id: d.kernel_name for d in before.nvme}
    names_after = {d.by_id: d.kernel_name for d in after.nvme}
    assert set(names_before) == set(names_after)
    assert names_before != names_after
    os_before = next(d.by_id for d in before.nvme if d.is_os_disk)
    os_after = next(d for d in after.nvme if d.is_os_disk)
    assert os_after.by_id == os_before and os_after.kernel_name == "nvme7n1"
    assert [(s.gpu_pci_address, s.nvme_by_id) for s in before.candidate_slots] == [
        (s.gpu_pci_address, s.nvme_by_id) for s in after.candidate_slots
    ]


async def test_disk_with_old_partition_table_reports_signatures_and_is_not_offered(tmp_path: Path) -> None:
    desc = xe9680l("lab-03", disk_file_bytes=1 << 20)
    desc.nvme[1] = desc.nvme[1].model_copy(update={"dos_label": True})
    root = build_host_root(tmp_path / "host", desc)
    report = await discover(Host.at(root), "lab-03")
    dirty = next(d for d in report.nvme if d.kernel_name == f"nvme{desc.nvme[1].ctrl}n1")
    assert dirty.signatures == ["dos@0x1fe"]
    assert not dirty.candidate and dirty.excluded_reason == "signatures_present"
    # A disk leased to a running slice carries its image: it stays a candidate.
    leased = await discover(Host.at(root), "lab-03", leased_by_id=[dirty.by_id])
    assert next(d for d in leased.nvme if d.by_id == dirty.by_id).candidate


# --- parity ---------------------------------------------------------------------------------------------


async def test_healthy_host_passes_every_parity_check(tmp_path: Path) -> None:
    root = build_host_root(tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, mounted_share=False))
    host = Host.at(root)
    report = await ParityChecker(host, topology=await discover(host, "xe9680l-01")).run("xe9680l-01")
    assert report.failures == 0 and report.warnings == 0
    assert [c.check for c in report.checks] == [
        "kvm",
        "iommu_groups",
        "vfio_modules",
        "libvirtd",
        "ovs_bridge",
        "dnsmasq_gpu_subnet",
        "nat_rule",
        "ip_forwarding",
        "ipoib_netplan",
        "fabric_route",
        "network_baseline_service",
        "node_agent",
        "vfio_binding",
        "nvidia_persistenced",
        "nvidia_fabricmanager",
        "fabric_vfs_service",
        "vfio_devices_service",
        "ovs_bridge_service",
        "dnsmasq_service",
        "host_baseline",
        "tmfifo_net0",
        "bf3_peer",
        "reboot_required",
        "api_topology",
    ]
    assert all(c.status == "PASS" for c in report.checks)


async def test_api_topology_warns_when_only_local_checks_ran_or_blockers_remain(tmp_path: Path) -> None:
    root = build_host_root(tmp_path / "host", xe9680l(disk_file_bytes=1 << 20))
    host = Host.at(root)
    local = await ParityChecker(host).run("xe9680l-01")
    api = next(c for c in local.checks if c.check == "api_topology")
    assert (api.status, local.failures, local.warnings) == ("WARN", 0, 1)
    assert "only local checks ran" in api.detail and "not for scheduler approval" in (api.remediation or "")
    # The mounted /share disk leaves one GPU without a disk: a topology blocker, reported, not hidden.
    with_topology = await ParityChecker(host, topology=await discover(host, "xe9680l-01")).run("xe9680l-01")
    api = next(c for c in with_topology.checks if c.check == "api_topology")
    assert api.status == "WARN" and "0000:db:00.0" in api.detail


BROKEN = {
    "vmx_off": ({"kvm": False}, "kvm"),
    "no_iommu_groups": ({"iommu_groups": False}, "iommu_groups"),
    "vfio_not_loaded": ({"vfio_modules": False}, "vfio_modules"),
    "libvirtd_inactive": ({"libvirtd_active": False}, "libvirtd"),
    "missing_ovs_bridge": ({"ovs_bridge": None}, "ovs_bridge"),
    # The baseline rendered dnsmasq and NAT for the approved subnet; only the bridge's address is wrong.
    "bridge_wrong_address": ({"ovs_address": "10.200.0.1/24", "baseline_cidr": "10.100.0.1/24"}, "ovs_bridge"),
    "no_dnsmasq_subnet": ({"dnsmasq_gpu_subnet": False}, "dnsmasq_gpu_subnet"),
    "nat_rule_missing": ({"nat_rule": False}, "nat_rule"),
    "no_ip_forwarding": ({"ip_forward": False}, "ip_forwarding"),
    "no_ipoib_netplan": ({"ipoib_netplan": False}, "ipoib_netplan"),
    "no_fabric_route": ({"fabric_route": False}, "fabric_route"),
    "no_network_baseline": ({"network_baseline": None}, "network_baseline_service"),
    "node_agent_inactive": ({"node_agent_active": False}, "node_agent"),
    "gpu_on_nvidia_driver": ({"nvidia_bound_gpus": 1}, "vfio_binding"),
    "no_driverctl_overrides": ({"driverctl_overrides": False}, "vfio_binding"),
    "persistenced_active": ({"nvidia_persistenced_active": True}, "nvidia_persistenced"),
    "fabricmanager_bare_metal_mode": ({"fabricmanager_mode": 0}, "nvidia_fabricmanager"),
    "fabricmanager_vgpu_mode": ({"fabricmanager_mode": 2}, "nvidia_fabricmanager"),
    "fabricmanager_inactive": ({"fabricmanager_active": False}, "nvidia_fabricmanager"),
    "no_fabric_vfs_service": (
        {"slice_services": ("gpuaas-slice-vfio-devices", "gpuaas-slice-ovs-bridge")},
        "fabric_vfs_service",
    ),
    "no_vfio_devices_service": (
        {"slice_services": ("gpuaas-slice-fabric-vfs", "gpuaas-slice-ovs-bridge")},
        "vfio_devices_service",
    ),
    "no_ovs_bridge_service": (
        {"slice_services": ("gpuaas-slice-fabric-vfs", "gpuaas-slice-vfio-devices")},
        "ovs_bridge_service",
    ),
    "dnsmasq_inactive": ({"dnsmasq_active": False}, "dnsmasq_service"),
    "no_h200_ib_done": ({"h200_ib_done": False}, "host_baseline"),
    "reboot_pending": ({"reboot_required": True}, "reboot_required"),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
async def test_each_broken_variant_fails_exactly_its_check(tmp_path: Path, variant: str) -> None:
    overrides, check = BROKEN[variant]
    root = build_host_root(tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, **overrides))
    report = await ParityChecker(Host.at(root)).run("xe9680l-01")
    failed = [c for c in report.checks if c.status == "FAIL"]
    assert [c.check for c in failed] == [check]
    assert report.failures == 1 and failed[0].remediation


REMEDIATION = {
    "vfio_binding": "persistent driverctl overrides generated from the approved topology",
    "nvidia_persistenced": "nvidia-persistenced",
    "nvidia_fabricmanager": "nvidia-fabricmanager",
    "fabric_vfs_service": "gpuaas-slice-fabric-vfs",
    "vfio_devices_service": "gpuaas-slice-vfio-devices",
    "ovs_bridge_service": "gpuaas-slice-ovs-bridge",
    "dnsmasq_service": "ExecStartPost=",
    "host_baseline": "site-bootstrap/h200-ib/bootstrap.sh",
    "reboot_required": "GPUAAS_SLICE_REBOOT_IF_REQUIRED=1",
}


@pytest.mark.parametrize("variant", sorted(v for v, (_, c) in BROKEN.items() if c in REMEDIATION))
async def test_new_checks_carry_the_runbook_remediation(tmp_path: Path, variant: str) -> None:
    overrides, check = BROKEN[variant]
    root = build_host_root(tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, **overrides))
    report = await ParityChecker(Host.at(root)).run("xe9680l-01")
    failed = next(c for c in report.checks if c.check == check)
    assert REMEDIATION[check] in (failed.remediation or "")


# The BlueField management link (runbook: "optional tmfifo_net0 management evidence"; "BF3 RShim peer 192.168.100.2
# ping succeeds"): variant -> the checks it breaks. The fixture's peer answers only on the runbook's /30.
BF3_MANAGEMENT = {
    "no_tmfifo_net0": ({"tmfifo_address": None}, ["tmfifo_net0", "bf3_peer"]),
    "tmfifo_wrong_address": ({"tmfifo_address": "192.168.200.1/30"}, ["tmfifo_net0", "bf3_peer"]),
    "bf3_peer_silent": ({"bf3_peer_reachable": False}, ["bf3_peer"]),
}


@pytest.mark.parametrize("variant", sorted(BF3_MANAGEMENT))
async def test_bf3_management_link_is_warn_evidence_by_default(tmp_path: Path, variant: str) -> None:
    overrides, checks = BF3_MANAGEMENT[variant]
    root = build_host_root(tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, **overrides))
    report = await ParityChecker(Host.at(root)).run("xe9680l-01")
    assert report.failures == 0
    warned = [c for c in report.checks if c.status == "WARN" and c.check != "api_topology"]
    assert [c.check for c in warned] == checks
    assert all("optional management evidence" in c.detail and c.remediation for c in warned)


@pytest.mark.parametrize("variant", sorted(BF3_MANAGEMENT))
async def test_a_site_that_requires_the_bf3_management_link_fails_on_it(tmp_path: Path, variant: str) -> None:
    overrides, checks = BF3_MANAGEMENT[variant]
    root = build_host_root(tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, **overrides))
    report = await ParityChecker(Host.at(root), require_bf3_management=True).run("xe9680l-01")
    assert [c.check for c in report.checks if c.status == "FAIL"] == checks
    assert report.failures == len(checks)
    if "tmfifo_net0" in checks:
        tmfifo = next(c for c in report.checks if c.check == "tmfifo_net0")
        assert "network baseline service" in (tmfifo.remediation or "")


async def test_the_bf3_peer_is_probed_not_assumed_from_the_address(tmp_path: Path) -> None:
    # tmfifo_net0 has the runbook's address, yet the peer is silent: only the probe can tell.
    root = build_host_root(tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, bf3_peer_reachable=False))
    checks = {c.check: c for c in (await ParityChecker(Host.at(root)).run("xe9680l-01")).checks}
    assert checks["tmfifo_net0"].status == "PASS"
    assert checks["bf3_peer"].status == "WARN" and "192.168.100.2" in checks["bf3_peer"].detail
    # On an emulated-slot host the link does not exist: not applicable, whatever the site requires.
    emulated = await ParityChecker(Host.at(root), emulated=True, require_bf3_management=True).run("xe9680l-01")
    peer = next(c for c in emulated.checks if c.check == "bf3_peer")
    assert peer.status == "WARN" and "not applicable" in peer.detail


async def test_fabricmanager_in_shared_nvswitch_mode_passes(tmp_path: Path) -> None:
    desc = xe9680l(disk_file_bytes=1 << 20, fabricmanager_active=True, fabricmanager_mode=1)
    report = await ParityChecker(Host.at(build_host_root(tmp_path / "host", desc))).run("xe9680l-01")
    fm = next(c for c in report.checks if c.check == "nvidia_fabricmanager")
    assert fm.status == "PASS" and "FABRIC_MODE=1" in fm.detail


async def test_a_host_without_fabric_manager_has_no_partitions_to_check(tmp_path: Path) -> None:
    root = build_host_root(tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, fabricmanager_active=False))
    (root / "usr/share/nvidia/nvswitch/fabricmanager.cfg").unlink()
    (root / "usr/bin/nv-fabricmanager").unlink()
    report = await ParityChecker(Host.at(root)).run("xe9680l-01")
    fm = next(c for c in report.checks if c.check == "nvidia_fabricmanager")
    assert fm.status == "PASS" and "not installed" in fm.detail


# --- device binding: driverctl overrides from the approved topology ------------------------------------


async def test_entering_slice_mode_writes_overrides_for_the_approved_devices_and_leaving_removes_them(
    tmp_path: Path,
) -> None:
    # A host coming from baremetal: GPUs on nvidia, no override yet.
    desc = xe9680l(disk_file_bytes=1 << 20, driverctl_overrides=False, nvidia_bound_gpus=8)
    root = build_host_root(tmp_path / "host", desc)
    host = Host.at(root)
    overrides = root / "etc/driverctl.d"
    gpu = root / "sys/bus/pci/devices/0000:18:00.0/driver"
    assert os.readlink(gpu).endswith("/nvidia")
    approved = ["0000:18:00.0", "0000:29:00.1", "0000:2a:00.0", "0000:29:00.2"]  # two approved slots
    done = await enter_slice_mode(host, approved)
    assert list(done.set_override) == sorted(approved)
    assert sorted(p.name for p in overrides.iterdir()) == [f"pci-{d}" for d in sorted(approved)]
    assert all((overrides / f"pci-{d}").read_text().strip() == "vfio-pci" for d in approved)
    assert os.readlink(gpu).endswith("/vfio-pci") and not os.readlink(gpu).startswith("/")
    # Not approved: left alone.
    assert os.readlink(root / "sys/bus/pci/devices/0000:3a:00.0/driver").endswith("/nvidia")
    assert (await enter_slice_mode(host, approved)).empty  # idempotent
    # Only the approved devices are checked: parity passes its binding check.
    report = await ParityChecker(host).run("xe9680l-01")
    assert next(c for c in report.checks if c.check == "vfio_binding").status == "PASS"
    # A slot approved away: its override goes.
    assert list((await enter_slice_mode(host, approved[:2])).unset_override) == ["0000:29:00.2", "0000:2a:00.0"]
    left = await leave_slice_mode(host)
    assert list(left.unset_override) == sorted(approved[:2])
    assert not list(overrides.iterdir())
    assert os.readlink(gpu).endswith("/nvidia")
    assert os.readlink(root / "sys/bus/pci/devices/0000:29:00.1/driver").endswith("/mlx5_core")


async def test_historical_baseline_service_is_only_a_warning(tmp_path: Path) -> None:
    root = build_host_root(
        tmp_path / "host", xe9680l(disk_file_bytes=1 << 20, network_baseline="gpuaas-slice-host-net-baseline")
    )
    report = await ParityChecker(Host.at(root)).run("xe9680l-01")
    assert report.failures == 0 and report.warnings == 2  # and api_topology: only local checks ran
    assert [c.check for c in report.checks if c.status == "WARN"] == ["network_baseline_service", "api_topology"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("gpuaas-node-agent")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)


def test_cli_parity_prints_one_line_per_check_and_a_summary(tmp_path: Path) -> None:
    healthy = build_host_root(tmp_path / "ok", xe9680l(disk_file_bytes=1 << 20))
    res = _cli("parity", "--root", str(healthy))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 25 and all(line.startswith("GPUAAS_SLICE_PARITY ") for line in lines)
    assert "status=PASS check=kvm detail=" in lines[0]
    # Only local checks ran: api_topology warns, as the runbook's checker does without an API token.
    assert lines[-2].startswith("GPUAAS_SLICE_PARITY status=WARN check=api_topology detail=only\\ local")
    assert lines[-1].endswith("failures=0 warnings=1")

    broken = build_host_root(tmp_path / "bad", xe9680l(disk_file_bytes=1 << 20, nat_rule=False))
    res = _cli("parity", "--root", str(broken))
    assert res.returncode == 1
    nat = next(line for line in res.stdout.splitlines() if "check=nat_rule" in line)
    assert nat.startswith("GPUAAS_SLICE_PARITY status=FAIL check=nat_rule detail=") and " remediation=" in nat
    assert res.stdout.splitlines()[-1].endswith("failures=1 warnings=1")


@pytest.mark.parametrize(
    ("host", "reported"),
    [
        ({}, (512, 512)),
        ({"hugepages_1g_total": 512, "hugepages_1g_free": 384}, (512, 384)),
        # A host that staged no pages, and a kernel with no 1 GiB pool at all: both have none.
        ({"hugepages_1g_total": 0}, (0, 0)),
        ({"hugepages_1g_total": None}, (0, 0)),
    ],
)
async def test_topology_reports_1g_hugepages_from_sysfs(tmp_path: Path, host: dict, reported: tuple) -> None:
    root = build_host_root(tmp_path / "host", xe9680l("hp-01", disk_file_bytes=1 << 20, **host))
    pool = root / "sys/kernel/mm/hugepages/hugepages-1048576kB"
    assert pool.is_dir() == (host.get("hugepages_1g_total", 512) is not None)
    report = await discover(Host.at(root), "hp-01")
    assert (report.hugepages_1g_total, report.hugepages_1g_free) == reported


async def test_unreadable_hugepage_counts_are_reported_unknown(tmp_path: Path) -> None:
    root = build_host_root(tmp_path / "host", xe9680l("hp-02", disk_file_bytes=1 << 20))
    (root / "sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages").write_text("garbage\n")
    report = await discover(Host.at(root), "hp-02")
    assert (report.hugepages_1g_total, report.hugepages_1g_free) == (None, 512)


def test_cli_discover_json_is_the_topology_report(tmp_path: Path) -> None:
    root = build_host_root(tmp_path / "host", xe9680l("cli-01", disk_file_bytes=1 << 20))
    res = _cli("discover", "--root", str(root), "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["node_id"] == "cli-01"
    assert len(report["gpus"]) == 8 and len(report["nvme"]) == 9
    assert sum(s["complete"] for s in report["candidate_slots"]) == 7


def test_format_lines_escapes_blanks() -> None:
    from gpuaas_common.contract import messages as m
    from gpuaas_common.contract import utcnow

    report = m.NodeParityReported(
        node_id="n",
        checked_at=utcnow(),
        failures=1,
        warnings=0,
        checks=[
            m.ParityCheck(
                check="ipoib_netplan",
                status="FAIL",
                detail="command exited with 1",
                remediation="render /etc/netplan/60-ipoib.yaml",
            )
        ],
    )
    assert format_lines(report)[0] == (
        "GPUAAS_SLICE_PARITY status=FAIL check=ipoib_netplan detail=command\\ exited\\ with\\ 1 "
        "remediation=render\\ /etc/netplan/60-ipoib.yaml"
    )


async def test_module_ids_and_fabric_manager_come_from_the_hosts_own_tools(tmp_path: Path) -> None:
    """Issue 29, point 1: each GPU's module ID from `nvidia-smi -q`, on every GPU and candidate; the GPUs behind
    one PCIe switch form a valid NVLink pair; Fabric Manager's mode, version and unit state."""
    desc = xe9680l("mod-01", disk_file_bytes=1 << 20, fabricmanager_mode=1, fabricmanager_active=True)
    report = await discover(Host.at(build_host_root(tmp_path / "host", desc)), "mod-01")
    assert [g.module_id for g in report.gpus] == [1, 3, 2, 4, 5, 7, 6, 8]
    by_switch: dict[str | None, set[int | None]] = {}
    for g in report.gpus:
        by_switch.setdefault(g.pcie_switch, set()).add(g.module_id)
    assert sorted(map(sorted, by_switch.values())) == [[1, 3], [2, 4], [5, 7], [6, 8]]
    assert {c.gpu_pci_address: c.module_id for c in report.candidate_slots} == {
        g.pci_address: g.module_id
        for g in report.gpus
        if g.pci_address in {c.gpu_pci_address for c in report.candidate_slots}
    }
    fm = report.fabric_manager
    assert fm is not None and (fm.mode, fm.version, fm.active) == ("shared_nvswitch", "550.127.05", True)
    assert not [b for b in report.blockers if "module" in b]


async def test_a_doubled_module_id_is_a_blocker_and_no_driver_tools_is_no_map(tmp_path: Path) -> None:
    desc = xe9680l("mod-02", disk_file_bytes=1 << 20)
    desc.gpus[1] = desc.gpus[1].model_copy(update={"module_id": 1})
    report = await discover(Host.at(build_host_root(tmp_path / "a", desc)), "mod-02")
    assert "module ID 1 is claimed by 2 GPUs: 0000:18:00.0, 0000:2a:00.0" in report.blockers
    bare = xe9680l(
        "mod-03",
        disk_file_bytes=1 << 20,
        nvidia_smi=False,
        fabricmanager_version=None,
        fabricmanager_mode=0,
        fabricmanager_active=False,
    )
    report = await discover(Host.at(build_host_root(tmp_path / "b", bare)), "mod-03")
    assert {g.module_id for g in report.gpus} == {None} and not [b for b in report.blockers if "module" in b]
    # The config file alone (the default bare-metal mode, the unit stopped) still says what Fabric Manager is.
    assert report.fabric_manager is not None and report.fabric_manager.mode == "baremetal"
    assert (report.fabric_manager.version, report.fabric_manager.active) == (None, False)
