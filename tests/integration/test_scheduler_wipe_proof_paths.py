"""Every end of an allocation that could free a slot, through the scheduler's own handlers over real Postgres
(issue 26, point 1): a slot that may hold tenant data is back in service only on a wipe proof the scheduler
itself finds to satisfy the site's policy, else it waits in cleanup_blocked; "never written" is believed only
where the scheduler's log of the claim does not contradict it.

Release and repair are judged in test_scheduler_wipe_policy_and_force_release.py and test_scheduler_inventory.py;
here: the provision a restart interrupted (the agent wiped its disks and reports the proofs), failures and
releases that say the disk was never written, and a proof that comes after a forced release."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from gpuaas_common.bus import HandlerContext
from gpuaas_common.bus import deliver as bus_deliver
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.catalog import spec_for
from gpuaas_common.contract.envelope import Envelope
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.service_layer.handlers import Scheduler
from gpuaas_scheduler.service_layer.placement import PlacementPolicy

from .scheduler_db import accepted, admin_client, post, run_place, scheduler_pool, slot_rows


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        async with p.acquire() as conn:
            await synthetic.build(conn, slice_hosts=1)
        yield p


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(PlacementPolicy())


async def _deliver(pool: asyncpg.Pool, handler: Any, type_: str, payload: m.Payload) -> None:
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="test")
    ctx = HandlerContext(env, payload, spec_for(type_).address, "scheduler-allocation-events", 1)
    assert await bus_deliver(handler, ctx, UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories))


async def _placed_through(pool: asyncpg.Pool, statuses: tuple[str, ...], gpus: int = 2) -> m.PlacementPlaced:
    """Placed, then walked through `statuses` as the allocator's lifecycle events would move its slots."""
    placed = (await run_place(pool, accepted(gpus))).placed
    assert placed is not None
    came_from = "reserved"
    async with pool.acquire() as conn, conn.transaction():
        for to in statuses:
            await inv.set_slot_status(conn, placed.allocation_id, to, only_from=(came_from,))
            came_from = to
    return placed


def _ids(placed: m.PlacementPlaced) -> dict[str, Any]:
    return {"allocation_id": placed.allocation_id, "tenant_id": "t1", "shape": "gpu_slice"}


def _failed(placed: m.PlacementPlaced, cleanup_required: bool, proofs: list[m.WipeProof]) -> m.AllocationFailed:
    return m.AllocationFailed(
        **_ids(placed),
        state="failed",
        seq=5,
        reason_code="image_not_cached",
        reason="resume after restart impossible",
        node_id=placed.node_id,
        cleanup_required=cleanup_required,
        wipe_proofs=proofs,
    )


def _proofs(placed: m.PlacementPlaced, method: str, *, verified: bool = True) -> list[m.WipeProof]:
    return [
        m.WipeProof(device=s.nvme_by_id, method=method, verified=verified, verification="sampled blocks read back")
        for s in placed.slots
    ]


async def _site_policy(pool: asyncpg.Pool, policy: str) -> None:
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO site_wipe_policies (region, destructive_wipe_policy, set_by, reason) "
            "VALUES ('default', $1, 'ops', 'site standard')",
            policy,
        )


async def _rows(pool: asyncpg.Pool, placed: m.PlacementPlaced) -> list[dict[str, Any]]:
    rows = await slot_rows(pool, [s.slot_id for s in placed.slots])
    return [rows[s.slot_id] for s in placed.slots]


async def _live_claims(pool: asyncpg.Pool, placed: m.PlacementPlaced) -> int:
    async with pool.acquire() as conn:
        return await conn.fetchval(
            "SELECT count(*) FROM allocation_resource_claims WHERE allocation_id = $1 AND status <> 'released'",
            placed.allocation_id,
        )


# --- a provision a restart interrupted: wiped by the agent, judged here ------------------------------------


@pytest.mark.parametrize(
    ("site", "method", "expected"),
    [
        (None, "zero_fill", "available"),
        ("nvme_format", "zero_fill", "cleanup_blocked"),
        ("nvme_format", "nvme_format", "available"),
        ("crypto_erase", "blkdiscard", "cleanup_blocked"),
    ],
)
async def test_the_agents_wipe_after_a_restart_frees_the_slots_only_if_it_is_the_sites(
    pool, scheduler, site, method, expected
):
    """Before, the agent's wipe came as "never written" without its proof, and the slots went back to
    available whatever the site's policy: a crypto-erase site reused disks that were only discarded."""
    if site:
        await _site_policy(pool, site)
    placed = await _placed_through(pool, ("provisioning",))
    await _deliver(pool, scheduler.on_failed, "allocation.failed", _failed(placed, True, _proofs(placed, method)))
    rows = await _rows(pool, placed)
    assert {r["status"] for r in rows} == {expected}
    if expected == "available":
        assert {r["health_state"] for r in rows} == {"healthy"}
    else:
        assert {r["health_state"] for r in rows} == {"failed"}
        assert all(f"site default's {site} policy" in r["status_reason"] for r in rows)
    assert await _live_claims(pool, placed) == 0
    async with pool.acquire() as conn:
        path = [
            r["to_status"]
            for r in await conn.fetch(
                "SELECT to_status FROM slot_transitions WHERE slot_id = $1 AND allocation_id = $2 ORDER BY id",
                placed.slots[0].slot_id,
                placed.allocation_id,
            )
        ]
    assert path == ["provisioning", "cleanup", expected]


@pytest.mark.parametrize("flaw", ["one_missing", "one_unverified", "signatures_left"])
async def test_a_failed_attempt_frees_its_slots_only_when_every_disk_is_proven(pool, scheduler, flaw):
    placed = await _placed_through(pool, ("provisioning",))
    proofs = _proofs(placed, "blkdiscard")
    if flaw == "one_missing":
        proofs = proofs[1:]
    elif flaw == "one_unverified":
        proofs[0] = proofs[0].model_copy(update={"verified": False, "detail": "read back non-zero"})
    else:
        proofs[0] = proofs[0].model_copy(update={"signatures": ["ext4"]})
    await _deliver(pool, scheduler.on_failed, "allocation.failed", _failed(placed, True, proofs))
    first, second = await _rows(pool, placed)
    # The host keeps its leases on all of the task's disks until every one is proven: none comes back alone.
    assert (first["status"], second["status"]) == ("cleanup_blocked", "cleanup_blocked")
    assert "not proven wiped" in second["status_reason"]
    assert "image_not_cached" in first["status_reason"]


async def test_a_touched_failure_with_no_proof_blocks_the_slots(pool, scheduler):
    placed = await _placed_through(pool, ("provisioning",))
    await _deliver(pool, scheduler.on_failed, "allocation.failed", _failed(placed, True, []))
    assert {(r["status"], r["health_state"]) for r in await _rows(pool, placed)} == {("cleanup_blocked", "failed")}


# --- "never written": believed only where the scheduler's own log agrees --------------------------------------


async def test_a_failure_before_the_clone_returns_the_slots_without_a_wipe(pool, scheduler):
    placed = await _placed_through(pool, ("provisioning",))
    await _deliver(pool, scheduler.on_failed, "allocation.failed", _failed(placed, False, []))
    assert {r["status"] for r in await _rows(pool, placed)} == {"available"}


async def test_never_written_is_not_believed_for_a_slot_this_scheduler_saw_active(pool, scheduler):
    """An `allocation.failed` saying the disk was never written, for slots that ran the tenant's VM (active, then
    releasing): before, they went straight back to available."""
    placed = await _placed_through(pool, ("provisioning", "active", "releasing"))
    await _deliver(pool, scheduler.on_failed, "allocation.failed", _failed(placed, False, []))
    rows = await _rows(pool, placed)
    assert {(r["status"], r["health_state"]) for r in rows} == {("cleanup_blocked", "failed")}
    assert all("the slot was active" in r["status_reason"] for r in rows)
    assert await _live_claims(pool, placed) == 0


async def test_released_before_provisioning_is_not_believed_for_a_slot_that_was_provisioning(pool, scheduler):
    """`released` with no cleanup required says no task ever went to the host; a slot the scheduler moved to
    provisioning was sent one. Before, it went back to available without a wipe."""
    sent = await _placed_through(pool, ("provisioning", "releasing"))
    never = await _placed_through(pool, ("releasing",))
    for placed in (sent, never):
        unwritten = m.CleanupReport(required=False, verified=False, reason="released before provisioning")
        released = m.AllocationReleased(**_ids(placed), state="released", seq=4, cleanup=unwritten)
        await _deliver(pool, scheduler.on_released, "allocation.released", released)
    assert {r["status"] for r in await _rows(pool, sent)} == {"cleanup_blocked"}
    assert {r["status"] for r in await _rows(pool, never)} == {"available"}


# --- a proof after a forced release -------------------------------------------------------------------------


async def test_a_wipe_proof_after_a_force_release_frees_nothing_and_a_repair_still_needs_one(pool, scheduler):
    placed = await _placed_through(pool, ("provisioning",))
    async with admin_client(pool) as api:
        path = f"/v1/allocations/{placed.allocation_id}/force-release"
        status, body = await post(api, path, {"actor": "ops", "reason": "agent gone", "force": True})
        assert status == 200, body
        # The agent comes back, wipes the interrupted provision's disks and reports; the allocator passes it on.
        await _deliver(
            pool, scheduler.on_failed, "allocation.failed", _failed(placed, True, _proofs(placed, "blkdiscard"))
        )
        assert {r["status"] for r in await _rows(pool, placed)} == {"cleanup_blocked"}
        slot = placed.slots[0]
        # A repair takes no typed proof (issue 38): it asks the host to wipe, and the slot stays blocked.
        proof = _proofs(placed, "blkdiscard")[0].model_dump(exclude_none=True)
        status, body = await post(
            api, f"/v1/slots/{slot.slot_id}/repair", {"actor": "ops", "reason": "agent wiped", "wipe_proof": proof}
        )
        assert status == 422 and body["error"]["code"] == "typed_wipe_proof_refused", body
        status, body = await post(api, f"/v1/slots/{slot.slot_id}/repair", {"actor": "ops", "reason": "agent wiped"})
        assert status == 200 and body["slot"]["status"] == "cleanup_blocked" and body["wipe_task"], body
