"""A real `gpuaas-node-agent` process killed with SIGKILL mid-task and started again. A restart is not a failure:
the interrupted provision or release resumes under the same claim and fencing epoch and the task gets exactly one
result, succeeded, also after JetStream redelivers it. A provision that cannot resume is wiped and verified by the
agent itself, and the result carries the proof (no cleanup left for ops)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
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
from gpuaas_common.jetstream import provision
from gpuaas_dev.sim.dhcp_guest import SimulatedDhcpAndGuest
from gpuaas_dev.sim.fixture_host import build_host_root, xe9680l
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.servers import free_port
from gpuaas_dev.testing.waiting import eventually
from gpuaas_node_agent.adapters.discovery import stable_ids
from gpuaas_node_agent.adapters.host import HostFs

IMAGE = b"GPUAAS-KILL-TEST-IMAGE" * 200
IMAGE_PATH = "/var/lib/gpuaas/slice-images/slice.raw"


def _start(env: dict[str, str], log: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("gpuaas-node-agent")
    return subprocess.Popen([str(exe)], env=env, stdout=subprocess.DEVNULL, stderr=log.open("ab"))


class Agent:
    """One host root, one agent process (started, killed, started again), its DHCP/guest simulation."""

    def __init__(self, tmp_path: Path, nats_url: str, *, disk_mib: int = 4) -> None:
        self.node_id = f"kill-{uuid.uuid4().hex[:6]}"
        self.root = build_host_root(tmp_path / "host", xe9680l(self.node_id, disk_file_bytes=disk_mib << 20))
        self.image = self.root / IMAGE_PATH.lstrip("/")
        self.image.parent.mkdir(parents=True)
        self.image.write_bytes(IMAGE + bytes((1 << 20) - len(IMAGE)))
        self.by_id = stable_ids(HostFs(self.root))["nvme0n1"]
        self.disk = (self.root / self.by_id.lstrip("/")).resolve()
        self.ssh_port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
        self.env.update(
            GPUAAS_NATS_URL=nats_url,
            GPUAAS_NATS_INSECURE_DEV="true",
            GPUAAS_NODE_ID=self.node_id,
            GPUAAS_HOST_ROOT=str(self.root),
            GPUAAS_LIBVIRT_URI="test:///default",
            GPUAAS_HEALTH_HOST="127.0.0.1",
            GPUAAS_HEALTH_PORT="0",
            GPUAAS_READINESS_TIMEOUT_S="600",
            GPUAAS_TASK_ACK_WAIT_S="2",
            GPUAAS_SSH_PORT=str(self.ssh_port),
            # The guest here is a simulated SSH banner, not a machine to log in to (the lab's are).
            GPUAAS_READINESS_LOGIN="false",
            GPUAAS_LOG_LEVEL="INFO",
        )
        self.log = tmp_path / "agent.log"
        self.proc: subprocess.Popen | None = None
        self.dhcp = SimulatedDhcpAndGuest(
            self.root / "etc/gpuaas/dnsmasq-hosts",
            self.root / "var/lib/misc/dnsmasq.leases",
            self.ssh_port,
            poll_interval_s=0.05,
        )
        self.alloc = uuid.uuid4()

    def start(self) -> None:
        self.proc = _start(self.env, self.log)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def slot(self) -> m.SlotBinding:
        return m.SlotBinding(
            slot_id=f"{self.node_id}-s0",
            gpu_pci_address="0000:18:00.0",
            nvme_by_id=self.by_id,
            fabric_vf_pci_address="0000:29:00.1",
            mac="52:54:00:7e:00:01",
            private_ip="127.102.0.10",
            ovs_bridge="ovsbr0",
            numa_node=0,
            profile="h200_1g_24c_64g",
        )

    def provision_task(self) -> m.SliceVmProvision:
        return m.SliceVmProvision(
            task_id=f"prov-{self.alloc.hex[:12]}",
            allocation_id=self.alloc,
            node_id=self.node_id,
            fencing_epoch=1,
            deadline=utcnow() + timedelta(minutes=10),
            vm_name=f"kill-{self.alloc.hex[:12]}",
            slots=[self.slot()],
            image=m.ImageRef(
                slug="slice", digest_sha256=hashlib.sha256(self.image.read_bytes()).hexdigest(), image_path=IMAGE_PATH
            ),
            ssh_public_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGtpbGwgdGVzdA tenant@example"],
            hostname="kill-vm",
        )

    def release_task(self) -> m.SliceVmRelease:
        return m.SliceVmRelease(
            task_id=f"rel-{self.alloc.hex[:12]}",
            allocation_id=self.alloc,
            node_id=self.node_id,
            fencing_epoch=1,
            deadline=utcnow() + timedelta(minutes=10),
            vm_name=f"kill-{self.alloc.hex[:12]}",
            slots=[self.slot()],
        )


@pytest.fixture
async def bus(nats_server) -> AsyncIterator[tuple[BusSpy, Any]]:
    spy = await BusSpy(nats_server.url).start()
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await provision(js)
    try:
        yield spy, js
    finally:
        await nc.drain()
        await spy.stop()


async def _send(js: Any, node_id: str, task_type: str, task: Any) -> None:
    envelope = Envelope.wrap(
        task_type, task.model_dump(mode="json"), producer="allocator", correlation_id=str(task.allocation_id)
    )
    await js.publish(
        spec_for(task_type).subject(node_id=node_id),
        envelope.model_dump_json().encode(),
        headers={"Nats-Msg-Id": envelope.event_id},
    )


async def _exactly_one_stored_result(js: Any, agent: Agent, spy: BusSpy, task_id: str, delivered: int) -> dict:
    """JetStream redelivers the unacked task (ack wait 2 s); the agent answers from its record and acks. The stream
    holds exactly one result for the task, and every copy the spy saw is that one."""

    async def settled() -> bool:
        info = await js.consumer_info("NODE_TASKS", f"node-agent-{agent.node_id}")
        return info.num_ack_pending == 0 and info.num_pending == 0 and info.delivered.consumer_seq >= delivered

    await eventually(settled, timeout=60)
    stored = await js.subscribe(f"gpuaas.node.{agent.node_id}.report.task_result", ordered_consumer=True)
    msgs = []
    try:
        while True:
            msgs.append(json.loads((await stored.next_msg(timeout=1)).data))
    except nats.errors.TimeoutError:
        pass
    await stored.unsubscribe()
    mine = [mm for mm in msgs if mm["payload"]["task_id"] == task_id]
    assert len(mine) == 1, "never both, never lost"
    seen = spy.of_type("node.task_result", task_id=task_id)
    assert {e["event_id"] for e in seen} == {mine[0]["event_id"]}
    assert all(e["payload"] == mine[0]["payload"] for e in seen)
    return mine[0]["payload"]


async def test_sigkill_mid_provision_then_restart_resumes_and_succeeds_once(tmp_path: Path, nats_server, bus) -> None:
    spy, js = bus
    agent = Agent(tmp_path, nats_server.url)
    agent.start()
    try:
        await spy.wait_type("node.parity_reported", node_id=agent.node_id, timeout=30)
        task = agent.provision_task()
        await _send(js, agent.node_id, "slice.vm_provision", task)
        # No DHCP server yet: the agent waits for a lease that never comes, after the clone.
        await spy.wait_type("node.task_progress", task_id=task.task_id, phase="wait_ready", timeout=30)
        agent.kill()
        assert agent.disk.read_bytes()[: len(IMAGE)] == IMAGE
        assert not spy.of_type("node.task_result", task_id=task.task_id)

        # The guest comes up now; the restarted agent clones again, re-renders the seed, redefines the domain
        # (libvirt's test driver forgot it with the process) and re-checks readiness.
        await agent.dhcp.start()
        agent.start()
        result = await spy.wait_type("node.task_result", task_id=task.task_id, timeout=60)
        payload = result["payload"]
        assert (payload["status"], payload["reason_code"], payload["cleanup_required"]) == ("succeeded", None, False)
        assert payload["readiness"]["ssh_ready"] is True
        assert agent.disk.read_bytes()[: len(IMAGE)] == IMAGE
        stored = await _exactly_one_stored_result(js, agent, spy, task.task_id, delivered=2)
        assert stored["status"] == "succeeded"
    finally:
        agent.stop()
        await agent.dhcp.stop()
    text = agent.log.read_text()
    assert "task_recovering" in text and "task_resuming" in text


async def test_sigkill_mid_release_then_restart_resumes_the_wipe_and_succeeds_once(
    tmp_path: Path, nats_server, bus
) -> None:
    spy, js = bus
    # A disk big enough that the kill lands while it is being wiped.
    agent = Agent(tmp_path, nats_server.url, disk_mib=256)
    await agent.dhcp.start()
    agent.start()
    try:
        await spy.wait_type("node.parity_reported", node_id=agent.node_id, timeout=30)
        prov = agent.provision_task()
        await _send(js, agent.node_id, "slice.vm_provision", prov)
        assert (await spy.wait_type("node.task_result", task_id=prov.task_id, timeout=60))["payload"][
            "status"
        ] == "succeeded"
        release = agent.release_task()
        await _send(js, agent.node_id, "slice.vm_release", release)
        await spy.wait_type("node.task_progress", task_id=release.task_id, phase="wipe", timeout=30)
        agent.kill()
        assert not spy.of_type("node.task_result", task_id=release.task_id), "killed before the wipe finished"

        agent.start()
        result = await spy.wait_type("node.task_result", task_id=release.task_id, timeout=60)
        payload = result["payload"]
        assert (payload["status"], payload["cleanup_required"]) == ("succeeded", False)
        assert [p["verified"] for p in payload["wipe_proofs"]] == [True]
        assert agent.disk.read_bytes()[: len(IMAGE)] == bytes(len(IMAGE))
        stored = await _exactly_one_stored_result(js, agent, spy, release.task_id, delivered=3)
        assert stored["status"] == "succeeded"
    finally:
        agent.stop()
        await agent.dhcp.stop()


async def test_provision_that_cannot_resume_is_wiped_by_the_agent_with_proof(tmp_path: Path, nats_server, bus) -> None:
    spy, js = bus
    agent = Agent(tmp_path, nats_server.url)
    agent.start()
    try:
        await spy.wait_type("node.parity_reported", node_id=agent.node_id, timeout=30)
        task = agent.provision_task()
        await _send(js, agent.node_id, "slice.vm_provision", task)
        await spy.wait_type("node.task_progress", task_id=task.task_id, phase="wait_ready", timeout=30)
        agent.kill()
        assert agent.disk.read_bytes()[: len(IMAGE)] == IMAGE
        # While the agent is down the cached image goes away: the provision cannot be resumed.
        agent.image.unlink()

        agent.start()
        result = await spy.wait_type("node.task_result", task_id=task.task_id, timeout=60)
        payload = result["payload"]
        # Wiped by the agent, and said to be touched: the proof goes to the scheduler to be judged against the
        # site's policy; the slot is not freed on the agent's word (before, the result read as never touched).
        assert (payload["status"], payload["reason_code"], payload["disk_touched"]) == (
            "failed",
            "image_not_cached",
            True,
        )
        assert payload["cleanup_required"] is False  # the wipe the agent owed is done and verified
        assert [(p["device"], p["verified"]) for p in payload["wipe_proofs"]] == [(agent.by_id, True)]
        assert agent.disk.read_bytes() == bytes(agent.disk.stat().st_size)
        stored = await _exactly_one_stored_result(js, agent, spy, task.task_id, delivered=2)
        assert stored["status"] == "failed"
    finally:
        agent.stop()
    assert "task_interrupted_wiped" in agent.log.read_text()
