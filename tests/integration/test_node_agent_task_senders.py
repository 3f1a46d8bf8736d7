"""N6: a task type has one sender, and the agent takes a task only on its type's own subject.

The real agent process on a fixture host, tasks on a real nats-server. Every node task type has a subject of
its own (`gpuaas.node.<id>.tasks.<type>`), and the server lets each service publish only its own types' subjects
(tests/integration/test_bus_identities.py). Here the other half: a VM release put on the subject the image
pipeline publishes prewarms on (or the scheduler its discovery) is refused by the agent unread: terminated, one
log line, no task result, no dead letter, and the slot disk it named keeps its tenant's bytes.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from gpuaas_common.contract import Envelope, spec_for, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_dev.testing.waiting import eventually
from tests.integration.test_node_agent_restart import Agent, bus  # noqa: F401  (the fixture)

MARKER = b"TENANT-BYTES-NO-PREWARM-MAY-WIPE" * 32


async def _forge(js: Any, spy: Any, subject: str, type_: str, payload: m.Payload) -> int:
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="image-pipeline", correlation_id="forged")
    body = env.model_dump_json().encode()
    spy.allow_invalid(body)  # the contract says so too: this type does not travel there
    ack = await js.publish(subject, body, headers={"Nats-Msg-Id": env.event_id}, timeout=5)
    assert ack.stream == "NODE_TASKS", subject
    return ack.seq


async def test_a_task_on_another_types_subject_is_refused_unread(tmp_path: Path, nats_server, bus) -> None:  # noqa: F811
    spy, js = bus
    agent = Agent(tmp_path, nats_server.url)
    with agent.disk.open("r+b") as disk:
        disk.write(MARKER)
    agent.start()
    try:
        await spy.wait_type("node.parity_reported", node_id=agent.node_id, timeout=30)
        release = agent.release_task()
        forged = [
            # What a compromised image pipeline may publish: its prewarm subject, carrying a VM release.
            (spec_for("image.cache_prewarm").subject(node_id=agent.node_id), "slice.vm_release", release),
            # A compromised scheduler: its discovery subject, carrying a VM release too.
            (spec_for("slice.topology_discover").subject(node_id=agent.node_id), "slice.vm_release", release),
        ]
        sent = []
        for subject, type_, payload in forged:
            sent.append((subject, await _forge(js, spy, subject, type_, payload)))
        # Then a task on its own subject, from its own sender: taken and answered as always.
        ask = m.SliceParityCheck(
            task_id="parity-after-forgery", node_id=agent.node_id, deadline=utcnow() + timedelta(minutes=5)
        )
        env = Envelope.wrap("slice.parity_check", ask.model_dump(mode="json"), producer="scheduler", correlation_id="p")
        await js.publish(spec_for("slice.parity_check").subject(node_id=agent.node_id), env.model_dump_json().encode())
        await spy.wait_type("node.parity_reported", task_id="parity-after-forgery", timeout=30)

        async def settled() -> bool:
            info = await js.consumer_info("NODE_TASKS", f"node-agent-{agent.node_id}")
            return info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0

        await eventually(settled, timeout=30, what="the agent's durable settled")
    finally:
        agent.stop()
    assert not spy.of_type("node.task_result", task_id=release.task_id), "a refused task has no result"
    assert not spy.of_type("node.task_progress", task_id=release.task_id), "a refused task never started"
    assert not spy.of_type("dead_letter"), "a refusal stores nothing in the DLQ"
    assert agent.disk.read_bytes()[: len(MARKER)] == MARKER, "the release ran: the tenant's disk was wiped"
    refusals = [line for line in agent.log.read_text().splitlines() if '"message_refused"' in line]
    assert len(refusals) == len(forged), refusals
    for (subject, seq), line in zip(sent, refusals, strict=True):
        assert subject in line and f'"stream_seq": {seq}' in line and "slice.vm_release travels on" in line
    assert spy.violations == [], spy.violations
