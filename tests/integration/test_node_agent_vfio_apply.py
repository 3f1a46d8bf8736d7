"""The VFIO binding as the scheduler asks for it (issue 26, point 5): `slice.vfio_apply` over a real nats-server
to a real `gpuaas-node-agent` process on a generated XE9680L host tree (its driverctl the fixture's, which keeps
one override file per device and rebinds at once).

The agent binds the approved slots' GPUs and fabric VFs, keeps that set as the one parity's `vfio_binding`
checks (a device unbound by hand afterwards fails parity by name), refuses a binding naming a device that is no
GPU or fabric VF of its topology with the device named and nothing changed, refuses an unbind naming nothing it
had bound, and releases the devices on leaving slice mode. Every message is checked against the contract.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest

from gpuaas_common.contract import Envelope, spec_for, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_dev.sim.fixture_host import MIB, build_host_root, xe9680l
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.waiting import eventually

BIN = Path(sys.executable).parent
NODE = "vfio-n1"
SLOTS = [
    m.VfioSlot(slot_id="s0", gpu_pci_address="0000:18:00.0", fabric_vf_pci_address="0000:29:00.1"),
    m.VfioSlot(slot_id="s1", gpu_pci_address="0000:2a:00.0", fabric_vf_pci_address="0000:29:00.2"),
]
DEVICES = ["0000:18:00.0", "0000:29:00.1", "0000:29:00.2", "0000:2a:00.0"]


class Agent:
    def __init__(self, url: str, root: Path, spy: BusSpy) -> None:
        self.url, self.root, self.spy = url, root, spy
        self.nc: Any = None
        self.log_path: Path | None = None
        self.held_seen = 0

    async def send(self, type_: str, payload: m.Payload) -> None:
        """As the scheduler sends it: through JetStream onto the host's task subject."""
        env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="scheduler", correlation_id=NODE)
        ack = await self.nc.jetstream().publish(
            spec_for(type_).subject(node_id=NODE), env.model_dump_json().encode(), timeout=10
        )
        assert ack.stream == "NODE_TASKS"

    async def apply(self, action: str, slots: list[m.VfioSlot]) -> str:
        task_id = f"vfio-{uuid.uuid4().hex[:12]}"
        deadline = utcnow() + timedelta(minutes=5)
        task = m.SliceVfioApply(task_id=task_id, node_id=NODE, deadline=deadline, action=action, slots=slots)  # type: ignore[arg-type]
        await self.send("slice.vfio_apply", task)
        return task_id

    async def parity(self) -> str:
        task_id = f"parity-{uuid.uuid4().hex[:12]}"
        await self.send(
            "slice.parity_check",
            m.SliceParityCheck(task_id=task_id, node_id=NODE, deadline=utcnow() + timedelta(minutes=5)),
        )
        return task_id

    async def vfio_check(self, task_id: str) -> dict[str, Any]:
        report = await self.spy.wait_type("node.parity_reported", timeout=60, task_id=task_id)
        return next(c for c in report["payload"]["checks"] if c["check"] == "vfio_binding")

    async def dead_letter(self, task_id: str) -> dict[str, Any]:
        """The agent's next dead letter, held at home: hosts are off the DLQ path (issue 38), so a refused task is
        a `dead_letter_held` line in the agent's own log (its reason, never the body, so no task id: the refusals
        here are sent one at a time and each waits for its own line) and nothing on the bus."""
        assert self.log_path is not None

        def held() -> list[dict[str, Any]]:
            lines = []
            for line in self.log_path.read_text().splitlines():  # type: ignore[union-attr]
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "dead_letter_held" in record.values():
                    lines.append(record)
            return lines if len(lines) > self.held_seen else []

        letters = await eventually(held, timeout=60, what=f"the held dead letter of {task_id}")
        self.held_seen += 1
        assert not self.spy.of_type("dead_letter"), "a host publishes no dead letter"
        return letters[self.held_seen - 1]

    def overrides(self) -> list[str]:
        d = self.root / "etc/driverctl.d"
        return sorted(p.name.removeprefix("pci-") for p in d.iterdir()) if d.exists() else []


@pytest.fixture
async def agent(nats_server, tmp_path: Path) -> AsyncIterator[Agent]:
    root = tmp_path / "host"
    # A host that has not entered slice mode: no overrides, its GPUs on the host's nvidia driver.
    build_host_root(root, xe9680l(NODE, disk_file_bytes=MIB, driverctl_overrides=False, nvidia_bound_gpus=8))
    hypervisor = root / "var/lib/gpuaas/sim-hypervisor.xml"
    hypervisor.write_text("<node>\n</node>\n")
    spy = await BusSpy(nats_server.url).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_NATS_CREDS")}
    env |= {
        "GPUAAS_NATS_URL": nats_server.url,
        "GPUAAS_NODE_ID": NODE,
        "GPUAAS_HOST_ROOT": str(root),
        "GPUAAS_LIBVIRT_URI": f"test://{hypervisor}",
        "GPUAAS_RECONCILE_INTERVAL_S": "3600",
        "GPUAAS_HEALTH_PORT": "0",
    }
    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(str(BIN / "gpuaas-node-agent"), env=env, stdout=log, stderr=log)
        a = Agent(nats_server.url, root, spy)
        a.log_path = log_path
        a.nc = await nats.connect(nats_server.url)
        try:
            await eventually(
                lambda: proc.returncode is not None or spy.of_type("node.enrolled", node_id=NODE),
                timeout=120,
                what="the agent enrolled",
            )
            assert proc.returncode is None, log_path.read_text()[-3000:]
            yield a
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
            await a.nc.close()
            await spy.stop()
    assert spy.violations == [], spy.violations[:5]


async def test_the_approved_binding_is_applied_kept_for_parity_and_released_on_leaving(agent: Agent) -> None:
    # Before any binding: not slice mode.
    check = await agent.vfio_check(await agent.parity())
    assert check["status"] == "FAIL" and "has not entered slice mode" in check["detail"]

    check = await agent.vfio_check(await agent.apply("bind", SLOTS))
    assert (check["status"], check["detail"]) == ("PASS", "4 approved devices on vfio-pci")
    assert agent.overrides() == DEVICES

    # One device taken back by hand: the override set alone would not show it, the kept approved set does.
    driverctl = agent.root / "usr/sbin/driverctl"
    await asyncio.to_thread(
        subprocess.run, [str(driverctl), "unset-override", "0000:2a:00.0"], check=True, capture_output=True
    )
    check = await agent.vfio_check(await agent.parity())
    assert check["status"] == "FAIL"
    assert "0000:2a:00.0 no persistent vfio-pci override" in check["detail"]
    check = await agent.vfio_check(await agent.apply("bind", SLOTS))
    assert check["status"] == "PASS" and agent.overrides() == DEVICES

    # Leaving slice mode: every approved device goes back to its host driver, and parity says the host released
    # its binding as asked (a WARN: a converting host must still pass parity to be re-approved).
    check = await agent.vfio_check(await agent.apply("unbind", SLOTS))
    assert check["status"] == "WARN" and "left slice mode and released its binding" in check["detail"]
    assert agent.overrides() == []


async def test_a_binding_off_the_hosts_topology_or_an_unbind_of_nothing_bound_is_refused_with_nothing_changed(
    agent: Agent,
) -> None:
    await agent.vfio_check(await agent.apply("bind", SLOTS))
    assert agent.overrides() == DEVICES
    # The NVMe controller's function and an address nothing answers at: no GPU or fabric VF of this host.
    hostile = [*SLOTS, m.VfioSlot(slot_id="s9", gpu_pci_address="0000:c1:00.0", fabric_vf_pci_address="0000:77:00.3")]
    refused = await agent.apply("bind", hostile)
    letter = await agent.dead_letter(refused)
    assert letter["reason_code"] == "binding_refused"
    assert "0000:c1:00.0 is not a GPU or fabric VF of this host's topology" in letter["reason"]
    assert "0000:77:00.3 is not a GPU or fabric VF" in letter["reason"]
    stranger = m.VfioSlot(slot_id="s7", gpu_pci_address="0000:5d:00.0")
    letter = await agent.dead_letter(await agent.apply("unbind", [stranger]))
    assert (
        letter["reason_code"] == "binding_refused"
        and "names no device of this host's approved binding" in letter["reason"]
    )
    # Nothing changed: the same overrides, the same approved set in parity, no parity report for the refusals.
    assert agent.overrides() == DEVICES
    check = await agent.vfio_check(await agent.parity())
    assert (check["status"], check["detail"]) == ("PASS", "4 approved devices on vfio-pci")
    assert agent.spy.of_type("node.parity_reported", task_id=refused) == []
