"""A slot's disk changes tenant in the lab only through its host's wipe (issue 38), on the real loop device under a
real VM: a marker written on the slot's disk is read by a VM given that disk (through QEMU's own block device, the
bytes the guest reads), the production agent wipes the disk on the scheduler's `slice.slot_wipe` task and reports
its proof on its report subject, and then neither the host (the whole device, every byte) nor a fresh VM on the
slot reads the marker.

What the lab cannot do: walk a host converting. It has no MAAS machine to deploy to a baremetal tenant and back, so
the baremetal tenant here is the test writing as root on the host, and the scheduler's side (re-approval
`awaiting_wipe`, the proof judged against the site's policy) is test_scheduler_slot_wipe.py's and, on the fixture
fleet, test_host_marker_walk.py's. The VMs boot no OS (a TCG boot is minutes): they read their disk through QEMU's
monitor, the guest's block backend, not through a guest kernel.

It runs wherever the lab's pieces are installed and the process is root (see test_lab_slice.py), and there it
fails, never skips, when the lab does not work.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest

from gpuaas_common.contract.catalog import node_task_subject
from gpuaas_common.contract.envelope import Envelope, utcnow
from gpuaas_common.jetstream import provision
from gpuaas_dev.lab.agent import LabAgentConfig, start_agent
from gpuaas_dev.lab.lab import Lab, LabState
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.servers import NatsServer

from .lab_checks import domains, lab_only, run, virsh

pytestmark = lab_only  # why this is no skip left to rot: lab_checks.lab_only

NODE = "lab-host-1"
SLOT_ID = "lab-slot-0"
BLOCK = 4096
# The guest's disk device: libvirt names the first virtio disk virtio-disk0 (QEMU answers its id or its qdev path).
GUEST_DISK = ("virtio-disk0", "/machine/peripheral/virtio-disk0/virtio-backend")


@pytest.fixture(scope="module")
def lab(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory):
    # A 1 GiB slot: the host-side scan reads every byte of it.
    made = Lab(tmp_path_factory.mktemp("lab"), slots=1, slot_disk_gib=1)
    made.up(forwards={"nats": nats_server.port})
    try:
        yield made
    finally:
        assert made.down() == []


@pytest.fixture(scope="module")
async def bus(lab: Lab, nats_server: NatsServer) -> AsyncIterator[tuple[Any, BusSpy]]:
    nc = await nats.connect(nats_server.url)
    await provision(nc.jetstream())
    spy = await BusSpy(nats_server.url).start()
    start_agent(lab, LabAgentConfig(node_id=NODE, nats_url=nats_server.url))
    await spy.wait_type("node.enrolled", timeout=120, node_id=NODE)
    yield nc, spy
    await spy.stop()
    await nc.drain()
    assert spy.violations == []


def marker_offsets(size: int) -> list[int]:
    return [0, (size // 2) // BLOCK * BLOCK, size - BLOCK]


def write_marker(device: str, marker: bytes, offsets: list[int]) -> None:
    """What a tenant who is root on the host does: the marker on the slot's device itself, synced."""
    fd = os.open(device, os.O_WRONLY)
    try:
        for off in offsets:
            os.pwrite(fd, marker, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def marker_found_at(device: str, marker: bytes, size: int) -> list[int]:
    """Every offset of the whole device where the marker is (chunks overlap by the marker's length)."""
    chunk, found = 16 << 20, []
    with open(device, "rb", buffering=0) as f:
        pos = 0
        while pos < size:
            f.seek(pos)
            data = f.read(min(chunk + len(marker), size - pos))
            at = data.find(marker)
            while at != -1:
                found.append(pos + at)
                at = data.find(marker, at + 1)
            pos += chunk
    return sorted(set(found))


def start_vm(lab: Lab, st: LabState, name: str) -> None:
    """A VM given the slot's disk as the agent gives it (raw, no host cache), with no OS to boot: it idles in its
    firmware, its disk attached."""
    slot = st.slots[0]
    xml = f"""<domain type='qemu'>
  <name>{name}</name><memory unit='MiB'>128</memory><vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices>
    <disk type='block' device='disk'><driver name='qemu' type='raw' cache='none' io='native'/>
      <source dev='{slot.by_id}'/><target dev='vda' bus='virtio'/></disk>
  </devices>
</domain>"""
    path = Path(lab.root) / f"{name}.xml"
    path.write_text(xml)
    for step in (("define", str(path)), ("start", name)):
        done = virsh(st, *step)
        assert done.returncode == 0, f"virsh {step[0]}: {done.stderr}"


def stop_vm(st: LabState, name: str) -> None:
    virsh(st, "destroy", name)
    assert virsh(st, "undefine", name).returncode == 0
    assert name not in domains(st)


_DUMP = re.compile(r"^[0-9a-f]{8}:\s+((?:[0-9a-f]{2}\s)+)", re.MULTILINE)


def qmp(st: LabState, vm: str, command: str, **arguments: Any) -> Any:
    done = virsh(st, "qemu-monitor-command", vm, json.dumps({"execute": command, "arguments": arguments}))
    assert done.returncode == 0, f"{command}: {done.stderr}"
    return json.loads(done.stdout)["return"]


def vm_reads(st: LabState, name: str, offsets: list[int], length: int) -> list[bytes]:
    """The bytes the running VM's disk holds at `offsets`, read through its QEMU: the block node its disk device
    is attached to, exported read-only over NBD on a unix socket and read with qemu-io (a guest kernel's reads
    take this node too)."""
    [disk] = [b for b in qmp(st, name, "query-block") if b.get("qdev") in GUEST_DISK]
    sock_dir = Path(tempfile.mkdtemp(prefix="gpuaas-probe-"))
    sock_dir.chmod(0o777)  # QEMU may run as its own user
    sock = sock_dir / "nbd.sock"
    qmp(st, name, "nbd-server-start", addr={"type": "unix", "data": {"path": str(sock)}})
    try:
        qmp(
            st,
            name,
            "block-export-add",
            type="nbd",
            id="probe",
            name="probe",
            **{"node-name": disk["inserted"]["node-name"]},
        )
        out = []
        for off in offsets:
            done = run(
                ["qemu-io", "-r", "-f", "raw", f"nbd+unix:///probe?socket={sock}", "-c", f"read -v {off} {length}"]
            )
            assert done.returncode == 0 and f"read {length}/{length} bytes" in done.stdout, done.stdout + done.stderr
            data = bytes.fromhex("".join(m.group(1) for m in _DUMP.finditer(done.stdout)).replace(" ", ""))
            assert len(data) == length, done.stdout
            out.append(data)
        return out
    finally:
        qmp(st, name, "nbd-server-stop")
        shutil.rmtree(sock_dir, ignore_errors=True)


async def send_wipe(nc: Any, st: LabState) -> str:
    """The scheduler's slice.slot_wipe task for the lab's slot, on the host's task subject."""
    task_id = f"wipe-{uuid.uuid4().hex[:12]}"
    task = {
        "task_id": task_id,
        "node_id": NODE,
        "deadline": (utcnow() + timedelta(minutes=10)).isoformat(),
        "slots": [{"slot_id": SLOT_ID, "nvme_by_id": st.slots[0].by_id, "wipe_policy": "blkdiscard"}],
    }
    env = Envelope.wrap("slice.slot_wipe", task, producer="scheduler", correlation_id=task_id)
    await nc.jetstream().publish(
        node_task_subject("slice.slot_wipe", NODE), env.model_dump_json().encode(), headers={"Nats-Msg-Id": task_id}
    )
    return task_id


@pytest.mark.timeout(300)
async def test_a_marker_on_the_real_slot_disk_is_gone_after_the_agents_wipe_for_host_and_fresh_vm(lab: Lab, bus):
    nc, spy = bus
    st = lab.state
    assert st is not None
    slot = st.slots[0]
    marker = b"gpuaas-marker:" + secrets.token_hex(24).encode()
    offsets = marker_offsets(slot.size_bytes)
    write_marker(slot.by_id, marker, offsets)

    # A VM given the disk reads the marker where it was written: this read would show a skipped wipe.
    before = f"marker-before-{uuid.uuid4().hex[:6]}"
    start_vm(lab, st, before)
    try:
        assert vm_reads(st, before, offsets, len(marker)) == [marker] * len(offsets)
    finally:
        stop_vm(st, before)
    assert marker_found_at(slot.loop_device, marker, slot.size_bytes) == offsets

    # The production agent's wipe, asked as the scheduler asks it, answered on the host's report subject.
    task_id = await send_wipe(nc, st)
    report = await spy.wait_type("node.slot_wipe_reported", timeout=180, task_id=task_id)
    subjects = {s for s, d in spy.messages if d.get("type") == report["type"] and d["payload"]["task_id"] == task_id}
    assert all(s.startswith(f"gpuaas.node.{NODE}.") for s in subjects), subjects  # the host's own subject
    [outcome] = report["payload"]["outcomes"]
    proof = outcome["proof"]
    assert outcome["slot_id"] == SLOT_ID and proof is not None, outcome
    assert proof["device"] == slot.by_id and proof["verified"] is True and proof["signatures"] == [], proof
    assert proof["method"] in ("blkdiscard", "blkdiscard+zeroout", "zeroout"), proof
    assert "simulated" not in (proof["verification"] or "")  # a real block device, not a file stand-in

    # Nowhere on the device, read from the host, and not at the marker's places through a fresh VM's disk.
    assert marker_found_at(slot.loop_device, marker, slot.size_bytes) == []
    after = f"marker-after-{uuid.uuid4().hex[:6]}"
    start_vm(lab, st, after)
    try:
        assert vm_reads(st, after, offsets, BLOCK) == [bytes(BLOCK)] * len(offsets)
    finally:
        stop_vm(st, after)
