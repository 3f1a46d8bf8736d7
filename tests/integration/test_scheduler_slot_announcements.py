"""A host's slots announced on the bus (scheduler.slots_changed) against a real Postgres, through the admin API,
the release path and the claim audit: every change made outside placement (approval, disable, repair, retire,
force-release, a release or settlement that blocks a slot) writes one announcement to the outbox in the change's
transaction, carrying every slot of the host with its status and health under the host's next number; a refused
request, a replayed one, a placement and a release that gives the slots back healthy write none."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.unit_of_work import UnitOfWork, no_repositories
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.domain.claim_audit import Settlement
from gpuaas_scheduler.service_layer.claim_audit import release_settled
from gpuaas_scheduler.service_layer.handlers import release_allocation

from .scheduler_db import (
    accepted,
    admin_client,
    candidate,
    place_and_activate,
    post,
    report_ready,
    run_place,
    scheduler_pool,
)

SUBJECT = "gpuaas.scheduler.host.slots_changed"


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        yield p


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


async def announcements(pool) -> list[dict[str, Any]]:
    """The announcements in the outbox, oldest first, each checked against the contract."""
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT subject, body FROM outbox WHERE subject = $1 ORDER BY id", SUBJECT)
    validator = default_validator()
    return [validator.validate(r["subject"], bytes(r["body"]))["payload"] for r in rows]


def states(change: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {s["slot_id"]: (s["status"], s["health_state"]) for s in change["slots"]}


async def _host(api, pool) -> None:
    status, body = await post(
        api,
        "/v1/nodes",
        {
            "actor": "ops",
            "node_id": "h1",
            "kind": "slice_host",
            "hostname": "h1",
            "sku": "h200-sxm-slice",
            "maas_tags": [inv.TAG_SLICE],
        },
    )
    assert status == 200, body
    mounted = {"mounted": True, "mounted_children": ["nvme1n1p1"], "signatures": ["ext4"], "is_os_disk": False}
    candidates = [candidate(0), candidate(1, nvme_evidence=mounted), candidate(2)]
    status, body = await post(api, "/v1/nodes/h1/candidates", {"actor": "ops", "candidates": candidates}, method="PUT")
    assert status == 200, body
    await report_ready(pool, "h1")


async def test_each_admin_change_of_a_hosts_slots_is_announced_in_its_transaction(api, pool):
    await _host(api, pool)
    assert await announcements(pool) == []  # candidates are no slots
    status, body = await post(
        api, "/v1/nodes/h1/candidates/approve", {"actor": "alice", "candidate_ids": ["h1-c0", "h1-c1"], "reason": "new"}
    )
    assert status == 200, body
    [approved] = await announcements(pool)
    assert (approved["node_id"], approved["generation"], approved["cause"], approved["actor"]) == (
        "h1",
        1,
        "approval",
        "alice",
    )
    # The slot a rule refused is announced disabled, with why; the binding travels with each slot.
    assert states(approved) == {"h1-c0": ("available", "healthy"), "h1-c1": ("disabled", "healthy")}
    slots = {s["slot_id"]: s for s in approved["slots"]}
    assert "mounted" in slots["h1-c1"]["status_reason"]
    assert (slots["h1-c0"]["gpu_pci_address"], slots["h1-c0"]["private_ip"]) == ("0000:18:00.0", "10.100.0.10")

    key = uuid.uuid4().hex
    status, body = await post(api, "/v1/slots/h1-c0/disable", {"actor": "bob", "reason": "fan noise"}, key=key)
    assert status == 200, body
    # The same request again replays its answer: no second announcement.
    assert (await post(api, "/v1/slots/h1-c0/disable", {"actor": "bob", "reason": "fan noise"}, key=key))[0] == 200
    status, body = await post(api, "/v1/slots/h1-c0/repair", {"actor": "bob", "reason": "fan replaced"})
    assert status == 200, body
    status, body = await post(
        api, "/v1/nodes/h1/slots/retire", {"actor": "carol", "slot_ids": ["h1-c1"], "reason": "x"}
    )
    assert status == 200, body
    # Refused: a retired slot cannot be repaired, an unknown one not disabled. Nothing announced for either.
    assert (await post(api, "/v1/slots/h1-c1/repair", {"actor": "bob", "reason": "no"}))[0] == 409
    assert (await post(api, "/v1/slots/h1-nope/disable", {"actor": "bob", "reason": "no"}))[0] == 404

    changes = await announcements(pool)
    assert [(c["generation"], c["cause"], c["actor"]) for c in changes] == [
        (1, "approval", "alice"),
        (2, "disable", "bob"),
        (3, "repair", "bob"),
        (4, "retire", "carol"),
    ]
    assert states(changes[1])["h1-c0"] == ("disabled", "healthy")
    repaired = {s["slot_id"]: s for s in changes[2]["slots"]}["h1-c0"]
    assert (repaired["status"], repaired["health_state"]) == ("available", "healthy")
    assert "repaired by bob" in repaired["health_detail"]
    assert states(changes[3]) == {"h1-c0": ("available", "healthy"), "h1-c1": ("retired", "healthy")}
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT slots_announced FROM nodes WHERE node_id = 'h1'") == 4


async def test_a_blocking_release_a_force_release_and_a_settlement_are_announced_and_placement_is_not(api, pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, slots_per_host=4)
    node = "n00001"
    placed = await place_and_activate(pool)
    assert await announcements(pool) == []  # the claim and the lifecycle moves: the hot path announces nothing

    # A release whose proofs free nothing: a format where the policy is blkdiscard, and no proof for the other disk.
    first = placed.slots[0]
    proofs = [m.WipeProof(device=first.nvme_by_id, method="nvme_format", verified=True)]
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(
            conn, placed.allocation_id, m.CleanupReport(required=True, verified=True, wipe_proofs=proofs)
        )
    [blocked] = await announcements(pool)
    assert (blocked["node_id"], blocked["generation"], blocked["cause"], blocked["actor"]) == (
        node,
        1,
        "release",
        "scheduler",
    )
    held = {s.slot_id for s in placed.slots}
    assert {k for k, v in states(blocked).items() if v == ("cleanup_blocked", "failed")} == held
    assert len(blocked["slots"]) == 4  # every slot of the host, the never-placed ones too

    # A release that gives its slots back healthy is not announced.
    clean = await place_and_activate(pool)
    good = [m.WipeProof(device=s.nvme_by_id, method="blkdiscard", verified=True) for s in clean.slots]
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(
            conn, clean.allocation_id, m.CleanupReport(required=True, verified=True, wipe_proofs=good)
        )
    assert len(await announcements(pool)) == 1

    forced = (await run_place(pool, accepted(1))).placed
    assert forced is not None
    status, body = await post(
        api, f"/v1/allocations/{forced.allocation_id}/force-release", {"actor": "ops", "reason": "gone", "force": True}
    )
    assert status == 200, body
    settled = (await run_place(pool, accepted(1))).placed
    assert settled is not None
    async with UnitOfWork(pool, "scheduler", "scheduler", no_repositories) as uow:
        verdict = Settlement("release", "the allocator says it was released long ago")
        assert await release_settled(uow.conn, settled.allocation_id, verdict, uow.events) == 1
        await uow.commit()

    changes = await announcements(pool)
    assert [(c["generation"], c["cause"], c["actor"]) for c in changes] == [
        (1, "release", "scheduler"),
        (2, "force_release", "ops"),
        (3, "claim_audit", "claim-audit"),
    ]
    assert states(changes[1])[forced.slots[0].slot_id] == ("cleanup_blocked", "failed")
    assert states(changes[2])[settled.slots[0].slot_id] == ("cleanup_blocked", "failed")
