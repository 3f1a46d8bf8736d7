"""An independent checker: reads the databases and the streams directly (never through the services) and
lists every way the system disagrees with itself. Fuzzing and chaos runs end with it.

Each check returns human-readable violations; an empty list everywhere is the pass condition.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import asyncpg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from gpuaas_common.contract import AllocationState, Envelope, Shape, SlotStatus
from gpuaas_common.contract.messages import DeadLetter

from .databases import ServiceDatabases
from .waiting import eventually

TERMINAL = (AllocationState.RELEASED, AllocationState.FAILED, "rejected", AllocationState.UNSCHEDULABLE)
LIVE_SLOT_STATUSES = (SlotStatus.RESERVED, SlotStatus.PROVISIONING, SlotStatus.ACTIVE, SlotStatus.RELEASING)


async def database_violations(conn: ServiceDatabases) -> list[str]:
    """Rows that contradict each other across the allocator's and the scheduler's databases (superuser). Each
    lives in its own database, so what compares the two is joined here."""
    out: list[str] = []
    for row in await conn.fetch(
        "SELECT a.allocation_id, a.state, t.state AS last FROM allocator.allocations a "
        "LEFT JOIN LATERAL (SELECT state FROM allocator.allocation_timeline x WHERE x.allocation_id = a.allocation_id "
        "ORDER BY seq DESC LIMIT 1) t ON true WHERE t.state IS DISTINCT FROM a.state"
    ):
        out.append(f"allocation {row['allocation_id']} is {row['state']} but its timeline ends {row['last']}")
    states = {
        r["allocation_id"]: (r["state"], r["node_id"])
        for r in await conn.fetch("SELECT allocation_id, state, node_id FROM allocator.allocations")
    }
    claims = await conn.fetch(
        "SELECT allocation_id, node_id, status FROM scheduler.allocation_resource_claims WHERE status <> 'released'"
    )
    held = {(c["allocation_id"], c["node_id"]) for c in claims if c["status"] == "held"}
    for alloc, (state, node) in states.items():
        if state == "active" and (alloc, node) not in held:
            out.append(f"active allocation {alloc} holds no claim on its node {node}")
    ended = {t for t in TERMINAL if t != "failed"}
    live = Counter(c["allocation_id"] for c in claims)
    for alloc, n in live.items():
        state = states.get(alloc, (None, None))[0]
        if state is None or state in ended:
            what = "an allocation the allocator does not know" if state is None else f"a {state} allocation"
            out.append(f"{n} live claim(s) held for {what}: {alloc}")
    for row in await conn.fetch(
        "SELECT s.slot_id, s.status FROM scheduler.node_resource_slots s WHERE s.status = ANY($1::text[]) "
        "AND NOT EXISTS (SELECT 1 FROM scheduler.allocation_resource_claims c WHERE c.slot_id = s.slot_id "
        "AND c.status <> 'released')",
        list(LIVE_SLOT_STATUSES),
    ):
        out.append(f"slot {row['slot_id']} is {row['status']} with no live claim")
    for row in await conn.fetch(
        "SELECT s.slot_id FROM scheduler.node_resource_slots s WHERE s.status = 'available' AND EXISTS "
        "(SELECT 1 FROM scheduler.allocation_resource_claims c WHERE c.slot_id = s.slot_id AND c.status <> 'released')"
    ):
        out.append(f"slot {row['slot_id']} is available while a live claim holds it")
    out.extend(await double_booking(conn))
    for schema, n in (await outbox_backlog(conn)).items():
        if n:
            out.append(f"{n} event(s) still in {schema}'s outbox")
    return out


async def double_booking(conn: asyncpg.Connection | ServiceDatabases) -> list[str]:
    """The history, not only the end state: no two claims on one slot (or two whole-node claims on one node)
    whose lifetimes overlap."""
    rows = await conn.fetch(
        "SELECT a.slot_id, a.node_id, a.allocation_id AS first, b.allocation_id AS second "
        "FROM scheduler.allocation_resource_claims a JOIN scheduler.allocation_resource_claims b "
        "ON a.claim_id < b.claim_id AND a.allocation_id <> b.allocation_id AND ("
        "  (a.slot_id IS NOT NULL AND a.slot_id = b.slot_id) OR "
        "  (a.claim_kind = 'node_exclusive' AND b.claim_kind = 'node_exclusive' AND a.node_id = b.node_id)) "
        "WHERE tstzrange(a.created_at, coalesce(a.released_at, 'infinity')) && "
        "      tstzrange(b.created_at, coalesce(b.released_at, 'infinity'))"
    )
    out = [f"{r['slot_id'] or r['node_id']} was held by {r['first']} and {r['second']} at the same time" for r in rows]
    # A device two slots share (a slot redefined over another's disk, GPU or fabric VF), and a whole-node claim
    # beside a slot claim on the same node, are double bookings too although the slot ids differ.
    rows = await conn.fetch(
        "WITH held AS (SELECT c.claim_id, c.allocation_id, c.node_id, c.slot_id, c.claim_kind, d.kind, d.device, "
        "  tstzrange(c.created_at, coalesce(c.released_at, 'infinity')) AS span "
        "  FROM scheduler.allocation_resource_claims c "
        "  LEFT JOIN scheduler.node_resource_slots s ON s.slot_id = c.slot_id "
        "  LEFT JOIN LATERAL (VALUES ('gpu', s.gpu_pci_address), ('disk', s.nvme_by_id), "
        "    ('fabric device', s.fabric_vf_pci_address)) d(kind, device) ON c.claim_kind = 'slot') "
        "SELECT DISTINCT a.node_id, CASE WHEN a.claim_kind = b.claim_kind THEN a.kind ELSE 'node' END AS kind, "
        "  CASE WHEN a.claim_kind = b.claim_kind THEN a.device END AS device, "
        "  a.allocation_id AS first, b.allocation_id AS second FROM held a JOIN held b "
        "ON a.claim_id < b.claim_id AND a.allocation_id <> b.allocation_id AND a.node_id = b.node_id "
        "AND a.span && b.span "
        "AND ((a.kind = b.kind AND a.device = b.device AND a.slot_id <> b.slot_id) "
        "  OR (a.claim_kind = 'node_exclusive') <> (b.claim_kind = 'node_exclusive'))"
    )
    out += [
        f"{' '.join(filter(None, (r['kind'], r['device'])))} on {r['node_id']} was held by {r['first']} and "
        f"{r['second']} at the same time"
        for r in rows
    ]
    return out


async def allocations_and_claims(conn: ServiceDatabases) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every allocation (id, shape, state, node, MAAS machine) and every held claim with its slot's devices."""
    allocations = [
        dict(r)
        for r in await conn.fetch(
            "SELECT allocation_id::text, shape, state, node_id, maas_system_id FROM allocator.allocations"
        )
    ]
    claims = [
        dict(r)
        for r in await conn.fetch(
            "SELECT c.allocation_id::text, c.node_id, c.slot_id, c.claim_kind, s.gpu_pci_address, "
            "s.fabric_vf_pci_address, s.nvme_by_id FROM scheduler.allocation_resource_claims c "
            "LEFT JOIN scheduler.node_resource_slots s USING (slot_id) WHERE c.status = 'held'"
        )
    ]
    return allocations, claims


def lifecycle_violations(requested: list[str], allocations: list[dict[str, Any]]) -> list[str]:
    """Every requested allocation is known to the allocator (none lost) and settled: active or terminal."""
    by_id = {a["allocation_id"]: a for a in allocations}
    out = [f"allocation {a} was requested and the allocator has no record of it" for a in requested if a not in by_id]
    out += [
        f"allocation {a} is still {by_id[a]['state']}"
        for a in requested
        if a in by_id and by_id[a]["state"] not in (*TERMINAL, "active")
    ]
    return out


def vm_name(allocation_id: str) -> str:
    """The domain name the allocator gives a slice allocation's VM."""
    return f"gpuaas-{allocation_id[:8]}"


def host_violations(
    allocations: list[dict[str, Any]], claims: list[dict[str, Any]], hosts: dict[str, dict[str, Any]]
) -> list[str]:
    """At a quiet moment (nothing in flight), what the slice hosts run against what the control plane believes:
    exactly one running VM per active slice allocation, on the node it is placed on, passed exactly the GPUs
    and fabric devices its held claims name and given their disks; no VM that no active allocation explains.
    `hosts` is the simulated fleet's `/sim/hosts` answer."""
    out: list[str] = []
    active = {
        a["allocation_id"]: a
        for a in allocations
        if a["shape"] == Shape.GPU_SLICE and a["state"] == AllocationState.ACTIVE
    }
    by_name = {vm_name(a_id): a for a_id, a in active.items()}
    seen: dict[str, list[str]] = {}
    for node, host in hosts.items():
        for dom in host["domains"]:
            seen.setdefault(dom["name"], []).append(node)
            alloc = by_name.get(dom["name"])
            if alloc is None:
                out.append(f"VM {dom['name']} ({dom['state']}) on {node} belongs to no active slice allocation")
                continue
            if alloc["node_id"] != node:
                out.append(
                    f"VM {dom['name']} runs on {node} but {alloc['allocation_id']} is placed on {alloc['node_id']}"
                )
                continue
            if dom["state"] != "running":
                out.append(f"VM {dom['name']} of active {alloc['allocation_id']} is {dom['state']}")
            held = [c for c in claims if c["allocation_id"] == alloc["allocation_id"] and c["node_id"] == node]
            want_pci = sorted(
                (d or "").lower() for c in held for d in (c["gpu_pci_address"], c["fabric_vf_pci_address"]) if d
            )
            if sorted(p.lower() for p in dom.get("pci", [])) != want_pci:
                out.append(f"VM {dom['name']} holds PCI {dom.get('pci')} but its claims name {want_pci}")
            for c in held:
                if c["nvme_by_id"] and not any(str(c["nvme_by_id"]) in d for d in dom.get("disks", [])):
                    out.append(f"VM {dom['name']} lacks the disk {c['nvme_by_id']} of its claimed slot {c['slot_id']}")
    for name, nodes in seen.items():
        if len(nodes) > 1:
            out.append(f"VM {name} runs on {len(nodes)} hosts: {sorted(nodes)}")
    for name, alloc in by_name.items():
        if name not in seen:
            out.append(f"active slice allocation {alloc['allocation_id']} has no VM on {alloc['node_id']}")
    return out


def maas_violations(
    allocations: list[dict[str, Any]], machines: list[dict[str, Any]], baremetal_system_ids: set[str]
) -> list[str]:
    """The MAAS simulator's machines against the allocations: no allocation deployed twice (each deploy MAAS
    committed names its allocation as agent_name), exactly one deploy for each active baremetal allocation on
    its machine, which is Deployed for it; no baremetal machine Deployed that no active allocation explains, and
    none left in Failed deployment (a failed allocation's machine is released).
    `machines` is the simulator's `/_sim/machines` list."""
    out: list[str] = []
    known = {a["allocation_id"]: a for a in allocations}
    deploys: dict[str, list[str]] = {}
    for machine in machines:
        for d in machine["_sim"].get("deploys", []):
            deploys.setdefault(d["agent_name"], []).append(machine["system_id"])
    for alloc_id, where in deploys.items():
        if alloc_id not in known:
            out.append(f"MAAS deployed {where} for {alloc_id!r}, an allocation the allocator does not know")
        elif len(where) > 1:
            out.append(f"allocation {alloc_id} was deployed {len(where)} times: {where}")
    active = {a["maas_system_id"]: a for a in allocations if a["shape"] == "baremetal" and a["state"] == "active"}
    for system_id, a in active.items():
        if deploys.get(a["allocation_id"]) != [system_id]:
            out.append(
                f"active baremetal {a['allocation_id']} on {system_id} has deploys {deploys.get(a['allocation_id'])}"
            )
    for machine in machines:
        sid = machine["system_id"]
        if sid not in baremetal_system_ids:
            continue
        if machine["status_name"] == "Deployed" and sid not in active:
            out.append(f"machine {sid} is Deployed (for {machine['_sim'].get('agent_name')}) with no active allocation")
        if machine["status_name"] == "Failed deployment" and sid not in active:
            # The allocation failed with it, and its machine is released through MAAS (allocator failed_machines).
            out.append(f"machine {sid} is left in Failed deployment (for {machine['_sim'].get('agent_name')})")
        if sid in active and machine["status_name"] != "Deployed":
            out.append(f"machine {sid} of active {active[sid]['allocation_id']} is {machine['status_name']}")
        if sid in active and machine["_sim"].get("agent_name") != active[sid]["allocation_id"]:
            out.append(
                f"machine {sid} is deployed for {machine['_sim'].get('agent_name')}, not {active[sid]['allocation_id']}"
            )
    return out


async def outbox_backlog(dbs: ServiceDatabases) -> dict[str, int]:
    """Rows left in each outbox, by schema, over every service's database."""
    backlog: dict[str, int] = {}
    for pool in dbs.pools.values():
        async with pool.acquire() as conn:
            for r in await conn.fetch("SELECT table_schema FROM information_schema.tables WHERE table_name = 'outbox'"):
                schema = r["table_schema"]
                backlog[schema] = await conn.fetchval(f'SELECT count(*) FROM "{schema}".outbox')
    return backlog


async def wait_outboxes_empty(conn: ServiceDatabases, timeout_s: float) -> bool:
    """Whether every outbox emptied within `timeout_s`. A relay deletes what it published a moment later (with
    its next read, or on its own after a short grace), so an empty outbox is something to wait for."""

    async def empty() -> bool:
        return not any((await outbox_backlog(conn)).values())

    try:
        await eventually(empty, timeout=timeout_s, interval=0.1, what="outboxes empty")
    except TimeoutError:
        return False
    return True


async def wait_consumers_drained(
    js: JetStreamContext, consumers: list[tuple[str, str]], timeout_s: float = 120.0
) -> dict[str, dict[str, int]]:
    """Wait until every durable has nothing pending or unacknowledged; returns the last figures (on timeout
    a durable that never drained shows non-zero numbers, one that vanished shows `missing`)."""
    figures: dict[str, dict[str, int]] = {}

    async def drained() -> bool:
        for stream, durable in consumers:
            try:
                info = await js.consumer_info(stream, durable)
            except NotFoundError:
                figures[durable] = {"missing": 1}
                continue
            figures[durable] = {"pending": info.num_pending or 0, "ack_pending": info.num_ack_pending or 0}
        return not any(any(f.values()) for f in figures.values())

    try:
        await eventually(drained, timeout=timeout_s, interval=0.25, what="durable consumers drained")
    except TimeoutError:
        pass
    return figures


async def dead_letters(js: JetStreamContext, after_seq: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """Every message in the DLQ stream after `after_seq`, and what is wrong with any of them (not a valid
    dead letter, or one without a reason)."""
    info = await js.stream_info("DLQ")
    letters: list[dict[str, Any]] = []
    problems: list[str] = []
    first, last = max(info.state.first_seq, after_seq + 1), info.state.last_seq
    if not info.state.messages:
        return letters, problems
    for seq in range(first, last + 1):
        try:
            raw = await js.get_msg("DLQ", seq)
        except NotFoundError:
            continue
        try:
            env = Envelope.model_validate(json.loads(raw.data or b""))
            letter = DeadLetter.model_validate(env.payload)
        except ValueError as exc:
            problems.append(f"DLQ seq {seq} is not a valid dead letter: {str(exc)[:200]}")
            continue
        if not letter.reason.strip():
            problems.append(f"DLQ seq {seq} ({letter.consumer}) has no reason")
        letters.append(letter.model_dump(mode="json"))
    return letters, problems


def count_by(letters: list[dict[str, Any]], key: str) -> dict[str, int]:
    return dict(Counter(str(x[key]) for x in letters))
