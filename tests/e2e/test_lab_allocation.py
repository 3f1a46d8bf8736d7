"""A slice allocated through the whole stack onto a real VM in the lab, and released.

The dev stack runs with the lab host and no simulated slice host: the lab host is a MAAS machine of the fleet,
commissioned with the slice preflight, its production agent (in the lab's namespace, against the lab's own
libvirtd, QEMU/TCG) discovers its emulated slot and runs parity, the slot is approved through the scheduler's
admin API, and the pipeline service publishes the lab's slice image, which the host verifies in its cache. The
test is a portal: it asks for a slice with the tenant's key and follows the lifecycle, every message checked
against the contract.

One guest boots (two to four minutes under TCG on two cores). The agent is restarted while the guest boots and
resumes the same domain; the guest gets its reserved address from the lab's dnsmasq; the allocation's access is
enough to log in as the tenant, whose guest shows the slot's disk at its size; the real sshd refuses the
agent's login against any other host key; the release stops the guest gracefully, undefines it with its NVRAM,
drops the reservation, wipes the loop device with proof the scheduler accepts, and the slot is `available`
again. Stopping the stack removes the namespace and the loop device.

It runs wherever the lab's pieces are installed and the process is root (see test_lab_slice.py), and there it
fails, never skips, when the lab does not work.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuaas_dev.lab.agent import host_prefix
from gpuaas_dev.lab.lab import Lab
from gpuaas_dev.stack import Stack
from gpuaas_dev.stack.lab_host import LAB_NODE, LAB_SKU, restart_lab_agent
from gpuaas_dev.testing.waiting import eventually

from .conftest import scheduler_ok
from .lab_checks import domains, lab_only, run, virsh, zeros_sampled

pytestmark = lab_only  # why this is no skip left to rot: lab_checks.lab_only

BOOT_S = 600.0
GATEWAY_PORT = 8765


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Overrides the e2e stack: the lab host and no simulated slice host (the conftest's portal follows it)."""
    # Two slots: two guests at once show that slices cannot reach each other.
    s = Stack(
        tmp_path_factory.mktemp("labstack"),
        slice_hosts=0,
        baremetal_hosts=0,
        lab=True,
        lab_slots=2,
        unsafe_no_fsync=True,
    )
    s.start()
    lab: Lab = s.lab_host
    assert lab.state is not None
    netns, host_dir = lab.state.netns, lab.state.host_dir
    disks = [slot.by_id for slot in lab.state.slots]
    yield s
    s.stop()
    # Stopping the stack leaves nothing of the lab on the machine: no namespace, no disk link, no prefix.
    assert not Path(f"/run/netns/{netns}").exists()
    assert not any(Path(d).exists() or Path(d).is_symlink() for d in disks)
    assert not Path(host_dir).exists()


def _listen(lab: Lab, address: str) -> subprocess.Popen[bytes]:
    """A TCP listener on the host's side of the lab's bridge, inside the namespace: what a guest's gateway answers."""
    argv = lab.ns(sys.executable, "-m", "http.server", "--bind", address, str(GATEWAY_PORT))
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(10)


def _listening(lab: Lab, address: str) -> bool:
    return f"{address}:{GATEWAY_PORT}" in run(lab.ns("ss", "-ltnH")).stdout


def _read(path: str) -> str:
    return Path(path).read_text()


def _files(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir())


@pytest.mark.timeout(1500)
async def test_slices_allocated_through_the_stack_run_on_real_vms_isolated_and_come_back(
    stack: Stack, portal, db, tmp_path
):
    lab: Lab = stack.lab_host
    st = lab.state
    assert st is not None and stack.lab_image is not None
    # Onboarded as a GPU host is: commissioned, parity of the emulated profile passed, the slots approved.
    node = (await scheduler_ok(stack, "GET", f"/v1/nodes/{LAB_NODE}"))["node"]
    assert node["parity_failures"] == 0 and node["mode"] == "slice"
    evidence = await db.fetchrow(
        "SELECT preflight_status, parity_detail FROM scheduler.nodes WHERE node_id = $1", LAB_NODE
    )
    assert evidence["preflight_status"] == "passed"
    assert json.loads(evidence["parity_detail"])["profile"] == "emulated"
    approved = {s["nvme_by_id"]: s for s in (await scheduler_ok(stack, "GET", f"/v1/nodes/{LAB_NODE}/slots"))["slots"]}
    assert set(approved) == {slot.by_id for slot in st.slots}
    assert all(s["emulated"] and s["gpu_pci_address"] is None and s["status"] == "available" for s in approved.values())

    tenant = tmp_path / "tenant"
    assert run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tenant)]).returncode == 0
    key = tenant.with_suffix(".pub").read_text().strip()
    allocs = [
        await portal.request("gpu_slice", 1, sku=LAB_SKU, image=stack.lab_image["slug"], ssh_public_keys=[key])
        for _ in st.slots
    ]
    spy = portal.spy
    for alloc in allocs:
        placed = await portal.wait_state(alloc, "placed", timeout=60)
        assert placed["payload"]["node_id"] == LAB_NODE

    # Restarted while the guests boot: the new agent resumes the domains it made, never a second one.
    booting = [
        await spy.wait_type("node.task_progress", timeout=300, allocation_id=a, phase="wait_ready") for a in allocs
    ]
    uuids = {vm: virsh(st, "domuuid", vm).stdout.strip() for vm in domains(st)}
    assert len(uuids) == len(allocs)
    restart_lab_agent(stack, lab)

    actives = [await portal.wait_state(a, "active", timeout=BOOT_S) for a in allocs]
    assert {vm: virsh(st, "domuuid", vm).stdout.strip() for vm in domains(st)} == uuids
    for progress in booting:
        resumed = spy.of_type("node.task_progress", task_id=progress["payload"]["task_id"], phase="wait_ready")
        assert any("resumed" in (e["payload"]["detail"] or "") for e in resumed)
    accesses = [a["payload"]["access"] for a in actives]
    leases = _read(st.lease_file)
    by_ip = {s["private_ip"]: s for s in approved.values()}
    for access in accesses:
        assert access["ip"] in by_ip and access["port"] == 22 and access["ssh_ready"]
        assert by_ip[access["ip"]]["mac"] in leases  # the lab's dnsmasq handed out each reservation
    task_id = booting[0]["payload"]["task_id"]
    result = spy.of_type("node.task_result", task_id=task_id)[-1]["payload"]
    assert {"lease", "ssh", "cloud_init"} <= set(result["readiness"]["phase_seconds"])

    # Each guest's port on the lab's bridge is isolated in the kernel.
    for vm in uuids:
        (tap,) = [line.split()[0] for line in virsh(st, "domiflist", vm).stdout.splitlines()[2:] if line.strip()]
        assert "isolated on" in run(lab.ns("bridge", "-d", "link", "show", "dev", tap)).stdout

    # The allocation's access is enough to log in as the tenant, trusting exactly the host key it names.
    known = tmp_path / "known_hosts"
    scans = [run(lab.ns("ssh-keyscan", "-t", "ed25519", a["ip"])).stdout for a in accesses]
    known.write_text("".join(scans))
    prints = {line.split()[2]: line.split()[1] for line in run(["ssh-keygen", "-lf", str(known)]).stdout.splitlines()}
    assert all(prints[a["ip"]] == a["host_key_fingerprint"] for a in accesses)

    def tenant_ssh(access: dict[str, Any], command: str) -> subprocess.CompletedProcess[str]:
        return run(
            lab.ns(
                "ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={known}", "-i", str(tenant), "-p", str(access["port"]),
                f"{access['user']}@{access['ip']}", command,
            ),
            timeout=120,
        )  # fmt: skip

    first = accesses[0]
    ssh = tenant_ssh(first, "lsblk -bdno SIZE /dev/vda; cloud-init status")
    assert ssh.returncode == 0, ssh.stderr
    slot_size = {slot.by_id: slot.size_bytes for slot in st.slots}[by_ip[first["ip"]]["nvme_by_id"]]
    assert int(ssh.stdout.split()[0]) == slot_size  # the slot's disk, at the size the slot declares

    # Slices never reach each other; each reaches its gateway (a listener on the host's side of the bridge).
    gateway = str(ipaddress.ip_interface(st.bridge_cidr).ip)
    listener = _listen(lab, gateway)
    try:
        await eventually(lambda: _listening(lab, gateway), 30, 0.1, "the gateway listener")
        for here, there in ((accesses[0], accesses[1]), (accesses[1], accesses[0])):
            probe = tenant_ssh(
                here,
                f"for t in {there['ip']}:22 {gateway}:{GATEWAY_PORT}; do "
                'if timeout 5 bash -c "exec 3<>/dev/tcp/${t%:*}/${t#*:}" 2>/dev/null; '
                'then echo "$t open"; else echo "$t closed"; fi; done',
            )
            assert probe.returncode == 0, probe.stderr
            assert probe.stdout.split("\n")[:2] == [f"{there['ip']}:22 closed", f"{gateway}:{GATEWAY_PORT} open"]
    finally:
        _stop(listener)

    # The real sshd refuses the agent's login made against any host key but the one the seed planted.
    other = tmp_path / "other_host"
    assert run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)]).returncode == 0
    agent_key = host_prefix(lab) / "var/lib/gpuaas/agent/readiness_ed25519"
    probe_login = (
        "import asyncio, sys; from pathlib import Path; from gpuaas_node_agent.adapters import guest_ssh; "
        "o = asyncio.run(guest_ssh.login(sys.argv[1], 22, sys.argv[2], Path(sys.argv[3]), sys.argv[4])); "
        "print(o.ok, o.host_key_mismatch)"
    )
    args = [first["ip"], first["user"], str(agent_key)]
    wrong = run(lab.ns(sys.executable, "-c", probe_login, *args, other.with_suffix(".pub").read_text().strip()))
    assert wrong.stdout.split() == ["False", "True"], wrong.stderr
    right = run(lab.ns(sys.executable, "-c", probe_login, *args, scans[0].split(None, 1)[1].strip()))
    assert right.stdout.split() == ["True", "False"], right.stderr

    # Release: graceful stop, undefine with NVRAM, reservation gone, the block device wiped with proof, and the
    # slot back in service on that proof.
    for alloc in allocs:
        await portal.release(alloc)
    for alloc in allocs:
        released = await portal.wait_state(alloc, "released", timeout=300)
        cleanup = released["payload"]["cleanup"]
        assert cleanup["verified"], json.dumps(cleanup)
        (proof,) = cleanup["wipe_proofs"]
        assert proof["device"] in approved and proof["verified"] and proof["signatures"] == []
        stopped = spy.of_type("node.task_progress", allocation_id=alloc, phase="undefine")
        assert stopped and stopped[0]["payload"]["detail"] == "stop path: graceful"
    assert domains(st) == []
    # The timeline says where the time went and how each VM stopped, readable without the host's logs.
    for alloc in allocs:
        notes = await db.fetch(
            "SELECT reason_code, detail FROM allocator.allocation_timeline WHERE allocation_id = $1 "
            "AND reason_code IN ('provision_phase', 'vm_stopped') ORDER BY seq",
            alloc,
        )
        rows = [
            (n["reason_code"], json.loads(n["detail"]) if isinstance(n["detail"], str) else n["detail"]) for n in notes
        ]
        phases = {d["phase"] for code, d in rows if code == "provision_phase"}
        # Both provisions were resumed by the restarted agent: it times the phases it ran itself (the boot's),
        # the ones before the restart died with the old process (test_allocation_flows.py sees them all).
        assert {"wait_ready", "lease", "cloud_init", "ssh"} <= phases
        assert [d["stop_path"] for code, d in rows if code == "vm_stopped"] == ["graceful"]
    assert _files(st.hostsdir) == []  # the DHCP reservations went with the VMs
    assert not any(s["mac"] in _read(st.lease_file) for s in approved.values())  # and their leases
    assert all(zeros_sampled(slot.loop_device, slot.size_bytes) for slot in st.slots)

    async def slots_available() -> bool:
        slots = (await scheduler_ok(stack, "GET", f"/v1/nodes/{LAB_NODE}/slots"))["slots"]
        return all(s["status"] == "available" for s in slots)

    await eventually(slots_available, 60, 0.2, "the wiped slots back in service")
