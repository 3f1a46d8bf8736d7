"""One fuzzing run against a running dev stack: warm up with real traffic, send the hostile input, wait until
every durable has drained, then read the DLQ and the databases with the independent checker."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import nats
from nats.aio.client import Client as NatsClient

from gpuaas_common.contract import Envelope, TaskType
from gpuaas_common.contract.catalog import ALL, node_task_subject
from gpuaas_common.contract.envelope import utcnow
from gpuaas_common.jetstream import CONSUMERS, node_agent_consumer

from ..stack import Stack
from .bus_spy import BusSpy
from .databases import ServiceDatabases
from .fuzz import Fuzzer, Pools, consumers_for, publisher
from .invariants import database_violations, dead_letters, wait_consumers_drained, wait_outboxes_empty

SLICE_REQUEST = {
    "tenant_id": "tenant-fuzz",
    "shape": "gpu_slice",
    "sku": "h200-sxm-slice",
    "gpu_count": 1,
    "image": "ubuntu-24.04-h200-slice",
    "ssh_public_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDev tenant@example"],
}


async def _portal_publish(js: Any, subject: str, type_: str, payload: dict[str, Any]) -> None:
    env = Envelope.wrap(type_, payload, producer="portal", correlation_id=str(payload["allocation_id"]))
    await js.publish(subject, env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id})


async def warm_up(stack: Stack, spy: BusSpy) -> None:
    """Real traffic to replay later: two slices to active, one of them released."""
    nc = await nats.connect(**stack.nats_options("portal"))
    js = nc.jetstream()
    ids = [str(uuid.uuid4()) for _ in range(2)]
    for alloc in ids:
        await _portal_publish(
            js, "gpuaas.allocation.requested", "allocation.requested", {**SLICE_REQUEST, "allocation_id": alloc}
        )
    for alloc in ids:
        await spy.wait_type("allocation.active", timeout=120, allocation_id=alloc)
    await _portal_publish(
        js, "gpuaas.allocation.release_requested", "allocation.release_requested", {"allocation_id": ids[0]}
    )
    await spy.wait_type("allocation.released", timeout=120, allocation_id=ids[0])
    await nc.drain()


async def recover_fleet(stack: Stack, spy: BusSpy, admin: NatsClient) -> dict[str, Any]:
    """What ops do after a host sent nonsense about itself: acknowledge the drift it claimed and ask its agent
    for a fresh discovery (topology and parity), which must come back clean. Hosts that reported failures
    are out of placement until then — that is the system working, not the fuzz breaking it."""
    out: dict[str, Any] = {"drift_acknowledged": {}, "parity_failures_after": {}}
    url, token = stack.scheduler_admin_url, stack.scheduler_admin_token
    headers = {"Authorization": f"Bearer {token}", "X-Actor": "fuzz-ops"}
    js = admin.jetstream()
    async with aiohttp.ClientSession() as http:
        for node in (n.node_id for n in stack.fleet.nodes if n.kind == "slice_host"):
            async with http.post(
                f"{url}/v1/nodes/{node}/drift/ack",
                json={"actor": "fuzz-ops", "reason": "fuzzed drift reports"},
                headers={**headers, "Idempotency-Key": str(uuid.uuid4())},
            ) as resp:
                out["drift_acknowledged"][node] = resp.status
            task_id = f"rediscover-{uuid.uuid4().hex[:12]}"
            env = Envelope.wrap(
                TaskType.SLICE_TOPOLOGY_DISCOVER,
                {"task_id": task_id, "node_id": node, "deadline": (utcnow() + timedelta(minutes=5)).isoformat()},
                producer="ops",
                correlation_id=task_id,
            )
            await js.publish(node_task_subject(env.type, node), env.model_dump_json().encode())
            parity = await spy.wait_type("node.parity_reported", timeout=120, task_id=task_id)
            await spy.wait_type("node.topology_reported", timeout=120, task_id=task_id)
            out["parity_failures_after"][node] = parity["payload"]["failures"]
    return out


def pools_from(stack: Stack, spy: BusSpy) -> Pools:
    nodes = [n.node_id for n in stack.fleet.nodes if n.kind == "slice_host"]
    pools = Pools(nodes=nodes)
    for subject, data in spy.messages:
        payload = data.get("payload") or {}
        if isinstance(payload, dict):
            if payload.get("allocation_id"):
                pools.allocations.append(str(payload["allocation_id"]))
            if payload.get("task_id"):
                pools.tasks.append(str(payload["task_id"]))
        spec = next((s for s in ALL if data.get("type") == s.type and s.subject_regex().match(subject)), None)
        if spec is None or not consumers_for(subject, nodes):
            continue
        node = subject.split(".")[2] if "node_id" in spec.parameters else None
        identity = publisher(spec, node)
        if identity:
            pools.replayable.append((subject, json.dumps(data).encode(), identity))
    return pools


async def run_fuzz(
    stack: Stack,
    spy: BusSpy,
    admin: NatsClient,
    db: ServiceDatabases,
    *,
    count: int,
    seed: int,
    drain_timeout_s: float = 180,
) -> dict[str, Any]:
    await warm_up(stack, spy)
    pools = pools_from(stack, spy)
    js_admin = admin.jetstream()
    dlq_before = (await js_admin.stream_info("DLQ")).state.last_seq
    hostile = Fuzzer(seed, pools).draw(count)

    conns: dict[str, NatsClient] = {}
    refused: Counter[str] = Counter()
    must: Counter[str] = Counter()
    started = time.monotonic()
    try:
        for item in hostile:
            if item.must_dead_letter:
                spy.allow_invalid(item.body.decode(errors="replace"))
            if item.identity not in conns:
                conns[item.identity] = await nats.connect(**stack.nats_options(item.identity))
            try:
                await conns[item.identity].jetstream().publish(item.subject, item.body, timeout=10)
            except Exception as exc:  # the server refusing the input is a pass for it, counted apart
                refused[f"{item.category}:{type(exc).__name__}"] += 1
                continue
            if item.must_dead_letter:
                must.update(item.durables)
        sent_s = time.monotonic() - started
    finally:
        for nc in conns.values():
            await nc.close()

    slice_nodes = list(pools.nodes)
    durables = [(c.stream, c.durable) for c in CONSUMERS] + [
        (c.stream, c.durable) for c in (node_agent_consumer(n) for n in slice_nodes)
    ]
    figures = await wait_consumers_drained(js_admin, durables, timeout_s=drain_timeout_s)
    drained_s = time.monotonic() - started
    letters, problems = await dead_letters(js_admin, after_seq=dlq_before)
    got = Counter(letter["consumer"] for letter in letters)
    # Hosts keep their dead letters at home (issue 38): an agent's durable leaves none on the bus, and each one it
    # held is a `dead_letter_held` line (reason, no body) in the fleet's log, counted here in their place, as is a
    # task refused unread for arriving on another type's subject (`message_refused`).
    held = _held_dead_letters(stack.log_path("node-agent"))
    for durable in [d for d in must if d.startswith("node-agent-")]:
        if got[durable]:
            problems.append(f"{durable}: {got[durable]} dead letters on the bus from a host")
        got[durable] = held[durable]
    await wait_outboxes_empty(db, timeout_s=30.0)  # a backlog left after that is a violation below
    violations = await database_violations(db)
    recovery = await recover_fleet(stack, spy, admin)
    return {
        "recovery": recovery,
        "seed": seed,
        "sent": len(hostile) - sum(refused.values()),
        "by_category": dict(Counter(h.category for h in hostile)),
        "by_type": dict(Counter(h.type or "?" for h in hostile)),
        "refused_by_server": dict(refused),
        "publish_s": round(sent_s, 2),
        "drained_s": round(drained_s, 2),
        "crashed_processes": stack.crashed(),
        "undrained_consumers": {d: f for d, f in figures.items() if any(f.values())},
        "dead_letters": len(letters),
        "dead_letters_by_reason": dict(Counter(letter["reason_code"] for letter in letters)),
        "dlq_problems": problems,
        "missing_dead_letters": {d: {"expected_at_least": n, "got": got[d]} for d, n in must.items() if got[d] < n},
        "database_violations": violations,
        "contract_violations_seen": len(spy.violations),
    }


def _held_dead_letters(log_path: Path) -> Counter[str]:
    """The dead letters the simulated fleet's agents held or refused unread, by consumer, from their log."""
    held: Counter[str] = Counter()
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") in ("dead_letter_held", "message_refused"):
            held[str(record.get("consumer"))] += 1
    return held
