"""A real `gpuaas-node-agent` process killed with SIGKILL mid-provision and started again: the task gets exactly
one result (failed with cleanup, since the disk was already written), also after JetStream redelivers it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import nats

from gpuaas_common.contract import Envelope, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import provision
from gpuaas_dev.sim.fixture_host import build_host_root, xe9680l
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.waiting import eventually
from gpuaas_node_agent.adapters.discovery import stable_ids
from gpuaas_node_agent.adapters.host import HostFs

IMAGE = b"GPUAAS-KILL-TEST-IMAGE" * 200


def _start(env: dict[str, str], log: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("gpuaas-node-agent")
    return subprocess.Popen([str(exe)], env=env, stdout=subprocess.DEVNULL, stderr=log.open("ab"))


async def test_sigkill_mid_provision_then_restart_reports_one_failed_result_with_cleanup(
    tmp_path: Path, nats_server
) -> None:
    node_id = f"kill-{uuid.uuid4().hex[:6]}"
    root = build_host_root(tmp_path / "host", xe9680l(node_id, disk_file_bytes=4 << 20))
    image = root / "var/lib/gpuaas/images/slice.raw"
    image.parent.mkdir(parents=True)
    image.write_bytes(IMAGE + bytes((1 << 20) - len(IMAGE)))
    by_id = stable_ids(HostFs(root))["nvme0n1"]
    disk = (root / by_id.lstrip("/")).resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
    env.update(
        GPUAAS_NATS_URL=nats_server.url,
        GPUAAS_NODE_ID=node_id,
        GPUAAS_HOST_ROOT=str(root),
        GPUAAS_LIBVIRT_URI="test:///default",
        GPUAAS_HEALTH_HOST="127.0.0.1",
        GPUAAS_HEALTH_PORT="0",
        GPUAAS_READINESS_TIMEOUT_S="600",
        GPUAAS_TASK_ACK_WAIT_S="2",
        GPUAAS_LOG_LEVEL="INFO",
    )
    log = tmp_path / "agent.log"

    spy = await BusSpy(nats_server.url).start()
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await provision(js)
    proc = _start(env, log)
    try:
        await spy.wait_type("node.parity_reported", node_id=node_id, timeout=30)
        alloc = uuid.uuid4()
        task = m.SliceVmProvision(
            task_id=f"prov-{alloc.hex[:12]}",
            allocation_id=alloc,
            node_id=node_id,
            fencing_epoch=1,
            deadline=utcnow() + timedelta(minutes=10),
            vm_name=f"kill-{alloc.hex[:12]}",
            slots=[
                m.SlotBinding(
                    slot_id=f"{node_id}-s0",
                    gpu_pci_address="0000:18:00.0",
                    nvme_by_id=by_id,
                    fabric_vf_pci_address="0000:29:00.1",
                    mac="52:54:00:7e:00:01",
                    private_ip="127.102.0.10",
                    ovs_bridge="ovsbr0",
                    numa_node=0,
                    profile="h200_1g_24c_64g",
                )
            ],
            image=m.ImageRef(
                slug="slice",
                digest_sha256=hashlib.sha256(image.read_bytes()).hexdigest(),
                image_path="/var/lib/gpuaas/images/slice.raw",
            ),
            ssh_public_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGtpbGwgdGVzdA tenant@example"],
            hostname="kill-vm",
        )
        envelope = Envelope.wrap(
            "slice.vm_provision", task.model_dump(mode="json"), producer="allocator", correlation_id=str(alloc)
        )
        await js.publish(
            f"gpuaas.node.{node_id}.tasks",
            envelope.model_dump_json().encode(),
            headers={"Nats-Msg-Id": envelope.event_id},
        )
        # No DHCP server on this host: the agent waits for a lease that never comes, after the clone.
        await spy.wait_type("node.task_progress", task_id=task.task_id, phase="wait_ready", timeout=30)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert disk.read_bytes()[: len(IMAGE)] == IMAGE
        assert not spy.of_type("node.task_result", task_id=task.task_id)

        proc = _start(env, log)
        result = await spy.wait_type("node.task_result", task_id=task.task_id, timeout=30)
        payload = result["payload"]
        assert (payload["status"], payload["reason_code"], payload["cleanup_required"]) == (
            "failed",
            "interrupted",
            True,
        )

        # JetStream redelivers the unacked task (ack wait 2 s); the agent answers from its record and acks.
        async def settled() -> bool:
            info = await js.consumer_info("NODE_TASKS", f"node-agent-{node_id}")
            # consumer_seq counts every delivery: 2 means the task was handed out again and then acked.
            return info.num_ack_pending == 0 and info.num_pending == 0 and info.delivered.consumer_seq >= 2

        await eventually(settled, timeout=30)
        seen = spy.of_type("node.task_result", task_id=task.task_id)
        assert {e["event_id"] for e in seen} == {result["event_id"]}
        assert all(e["payload"] == payload for e in seen)
        stored = await js.subscribe(f"gpuaas.node.{node_id}.report.task_result", ordered_consumer=True)
        msgs = []
        try:
            while True:
                msgs.append(json.loads((await stored.next_msg(timeout=1)).data))
        except nats.errors.TimeoutError:
            pass
        assert [mm["payload"]["status"] for mm in msgs] == ["failed"], "never both, never lost"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        await nc.drain()
        await spy.stop()
    assert "task_recovering" in log.read_text()
