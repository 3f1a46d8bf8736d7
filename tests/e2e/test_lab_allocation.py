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

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuaas_dev.lab import preflight
from gpuaas_dev.lab.agent import host_prefix
from gpuaas_dev.lab.lab import Lab, LabState
from gpuaas_dev.stack import Stack
from gpuaas_dev.stack.lab_host import LAB_NODE, LAB_SKU, restart_lab_agent
from gpuaas_dev.testing.waiting import eventually

pytestmark = pytest.mark.skipif(
    not preflight.installed() or os.geteuid() != 0,
    reason="the lab needs its Debian packages (scripts/setup.sh) and root for network namespaces",
)

BOOT_S = 600.0


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Overrides the e2e stack: the lab host and no simulated slice host (the conftest's portal follows it)."""
    s = Stack(tmp_path_factory.mktemp("labstack"), slice_hosts=0, baremetal_hosts=0, lab=True, unsafe_no_fsync=True)
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


def _virsh(st: LabState, *args: str) -> subprocess.CompletedProcess[str]:
    return _run(["virsh", "-c", st.libvirt_uri, *args])


def _domains(st: LabState) -> list[str]:
    return [n for n in _virsh(st, "list", "--all", "--name").stdout.split() if n]


def _read(path: str) -> str:
    return Path(path).read_text()


def _files(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir())


def _zeros_sampled(device: str, size: int, samples: int = 16) -> bool:
    with open(device, "rb") as f:
        for i in range(samples):
            f.seek((size // samples) * i)
            if f.read(65536).strip(b"\0"):
                return False
    return True


async def _scheduler(stack: Stack, path: str) -> Any:
    headers = {"Authorization": f"Bearer {stack.scheduler_admin_token}"}
    async with aiohttp.ClientSession(base_url=stack.scheduler_admin_url, headers=headers) as http:
        async with http.get(path) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


@pytest.mark.timeout(1200)
async def test_a_slice_allocated_through_the_stack_runs_on_a_real_vm_and_comes_back(stack: Stack, portal, db, tmp_path):
    lab: Lab = stack.lab_host
    st = lab.state
    assert st is not None and stack.lab_image is not None
    slot = st.slots[0]
    # Onboarded as a GPU host is: commissioned, parity of the emulated profile passed, the slot approved.
    node = (await _scheduler(stack, f"/v1/nodes/{LAB_NODE}"))["node"]
    assert node["parity_failures"] == 0 and node["mode"] == "slice"
    evidence = await db.fetchrow(
        "SELECT preflight_status, parity_detail FROM scheduler.nodes WHERE node_id = $1", LAB_NODE
    )
    assert evidence["preflight_status"] == "passed"
    assert json.loads(evidence["parity_detail"])["profile"] == "emulated"
    (approved,) = (await _scheduler(stack, f"/v1/nodes/{LAB_NODE}/slots"))["slots"]
    assert approved["emulated"] and approved["gpu_pci_address"] is None and approved["status"] == "available"
    assert approved["nvme_by_id"] == slot.by_id

    tenant = tmp_path / "tenant"
    assert _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tenant)]).returncode == 0
    alloc = await portal.request(
        "gpu_slice",
        1,
        sku=LAB_SKU,
        image=stack.lab_image["slug"],
        ssh_public_keys=[tenant.with_suffix(".pub").read_text().strip()],
    )
    spy = portal.spy
    placed = await portal.wait_state(alloc, "placed", timeout=60)
    assert placed["payload"]["node_id"] == LAB_NODE

    # Restarted while the guest boots: the new agent resumes the domain it made, never a second one.
    booting = await spy.wait_type("node.task_progress", timeout=300, allocation_id=alloc, phase="wait_ready")
    (vm_name,) = _domains(st)
    uuid_before = _virsh(st, "domuuid", vm_name).stdout.strip()
    restart_lab_agent(stack, lab)

    active = await portal.wait_state(alloc, "active", timeout=BOOT_S)
    assert _domains(st) == [vm_name]
    assert _virsh(st, "domuuid", vm_name).stdout.strip() == uuid_before
    task_id = booting["payload"]["task_id"]
    resumed = spy.of_type("node.task_progress", task_id=task_id, phase="wait_ready")
    assert any("resumed" in (e["payload"]["detail"] or "") for e in resumed)
    access = active["payload"]["access"]
    assert access["ip"] == approved["private_ip"] and access["port"] == 22 and access["ssh_ready"]
    assert approved["mac"] in _read(st.lease_file)  # the lab's dnsmasq handed out the reservation
    result = spy.of_type("node.task_result", task_id=task_id)[-1]["payload"]
    assert {"lease", "ssh", "cloud_init"} <= set(result["readiness"]["phase_seconds"])

    # The allocation's access is enough to log in as the tenant, trusting exactly the host key it names.
    known = tmp_path / "known_hosts"
    scan = _run(lab.ns("ssh-keyscan", "-t", "ed25519", access["ip"]))
    known.write_text(scan.stdout)
    assert _run(["ssh-keygen", "-lf", str(known)]).stdout.split()[1] == access["host_key_fingerprint"]
    ssh = _run(
        lab.ns(
            "ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={known}", "-i", str(tenant), "-p", str(access["port"]),
            f"{access['user']}@{access['ip']}", "lsblk -bdno SIZE /dev/vda; cloud-init status",
        ),
        timeout=120,
    )  # fmt: skip
    assert ssh.returncode == 0, ssh.stderr
    assert int(ssh.stdout.split()[0]) == slot.size_bytes  # the slot's disk, at the size the slot declares

    # The real sshd refuses the agent's login made against any host key but the one the seed planted.
    other = tmp_path / "other_host"
    assert _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)]).returncode == 0
    agent_key = host_prefix(lab) / "var/lib/gpuaas/agent/readiness_ed25519"
    probe = (
        "import asyncio, sys; from pathlib import Path; from gpuaas_node_agent.adapters import guest_ssh; "
        "o = asyncio.run(guest_ssh.login(sys.argv[1], 22, sys.argv[2], Path(sys.argv[3]), sys.argv[4])); "
        "print(o.ok, o.host_key_mismatch)"
    )
    args = [access["ip"], access["user"], str(agent_key)]
    wrong = _run(lab.ns(sys.executable, "-c", probe, *args, other.with_suffix(".pub").read_text().strip()))
    assert wrong.stdout.split() == ["False", "True"], wrong.stderr
    right = _run(lab.ns(sys.executable, "-c", probe, *args, scan.stdout.split(None, 1)[1].strip()))
    assert right.stdout.split() == ["True", "False"], right.stderr

    # Release: graceful stop, undefine with NVRAM, reservation gone, the block device wiped with proof, and the
    # slot back in service on that proof.
    await portal.release(alloc)
    released = await portal.wait_state(alloc, "released", timeout=300)
    cleanup = released["payload"]["cleanup"]
    assert cleanup["verified"], json.dumps(cleanup)
    (proof,) = cleanup["wipe_proofs"]
    assert proof["device"] == slot.by_id and proof["verified"] and proof["signatures"] == []
    assert _domains(st) == []
    assert _files(st.hostsdir) == []  # the DHCP reservation went with the VM
    assert _zeros_sampled(slot.loop_device, slot.size_bytes)
    stopped = spy.of_type("node.task_progress", allocation_id=alloc, phase="undefine")
    assert stopped and stopped[0]["payload"]["detail"] == "stop path: graceful"

    async def slot_available() -> bool:
        return (await _scheduler(stack, f"/v1/slots/{approved['slot_id']}"))["slot"]["status"] == "available"

    await eventually(slot_available, 60, 0.2, "the wiped slot back in service")
