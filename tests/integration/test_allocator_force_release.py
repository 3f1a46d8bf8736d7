"""The allocator ends an allocation the scheduler force-released (placement.force_released) on real Postgres:
failed with `force_released` and cleanup required, the task still out given up (its late answer recorded, not
applied), and a second copy or a finished allocation changes nothing."""

from __future__ import annotations

import json
import uuid

import pytest

from gpuaas_allocator.service_layer.commands import provision_task_id, release_task_id
from gpuaas_allocator.service_layer.handlers import PlacementNotSeenYet
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator

from .allocator_db import allocator_offering, pool, provisioning, requested, send, uow  # noqa: F401 (fixture)


def _forced(alloc: uuid.UUID) -> m.PlacementForceReleased:
    return m.PlacementForceReleased(
        allocation_id=alloc,
        node_ids=["n1"],
        slot_ids=[f"n1-{alloc.hex[:6]}"],
        actor="ops",
        reason="host unreachable",
        forced=True,
        holders=[f"slot n1-{alloc.hex[:6]} is provisioning: the allocation's VM may still hold its GPU and disk"],
    )


async def _failed_events(pool, alloc):  # noqa: F811
    validator = default_validator()
    rows = await pool.fetch("SELECT subject, body FROM outbox WHERE subject = 'gpuaas.allocation.event.failed'")
    payloads = [validator.validate(r["subject"], bytes(r["body"]))["payload"] for r in rows]
    return [p for p in payloads if p["allocation_id"] == str(alloc)]


async def test_a_force_released_allocation_fails_with_cleanup_and_its_task_is_given_up(pool) -> None:  # noqa: F811
    allocator = await allocator_offering(pool)
    alloc = await provisioning(pool, allocator)
    await send(pool, allocator.on_force_released, "placement.force_released", _forced(alloc))
    row = await pool.fetchrow("SELECT * FROM allocations WHERE allocation_id = $1", alloc)
    assert (row["state"], row["failure_code"], row["awaiting_result"], row["timed_out_task_id"]) == (
        "failed",
        "force_released",
        False,
        provision_task_id(allocator.settings, alloc),
    )
    [event] = await _failed_events(pool, alloc)
    assert (event["reason_code"], event["cleanup_required"]) == ("force_released", True)
    assert "force-released by ops: host unreachable" in event["reason"]

    # A second copy changes nothing.
    await send(pool, allocator.on_force_released, "placement.force_released", _forced(alloc))
    assert len(await _failed_events(pool, alloc)) == 1

    # The agent answers the provision after all: recorded on the timeline, not applied.
    await send(
        pool,
        allocator.on_task_result,
        "node.task_result",
        m.NodeTaskResult(
            task_id=provision_task_id(allocator.settings, alloc),
            allocation_id=alloc,
            node_id="n1",
            task_type="slice.vm_provision",
            status="succeeded",
        ),
    )
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc) == "failed"
    late = await pool.fetchrow(
        "SELECT reason_code, detail FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq DESC", alloc
    )
    assert late["reason_code"] == "late_task_result_ignored" and json.loads(late["detail"])["status"] == "succeeded"
    # The VM it built runs on slots ops released: it is torn down.
    teardown = await pool.fetch("SELECT body FROM outbox WHERE subject = 'gpuaas.node.n1.tasks.slice.vm_release'")
    released = [json.loads(r["body"]) for r in teardown if json.loads(r["body"])["type"] == "slice.vm_release"]
    assert [t["payload"]["task_id"] for t in released] == [release_task_id(allocator.settings, alloc)]


async def test_before_its_placement_is_applied_the_message_is_retried_not_failed(pool) -> None:  # noqa: F811
    allocator = await allocator_offering(pool)
    alloc = await requested(pool, allocator)
    with pytest.raises(PlacementNotSeenYet):
        await send(pool, allocator.on_force_released, "placement.force_released", _forced(alloc))
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc) == "accepted"
    # Unknown allocations are a no-op.
    await send(pool, allocator.on_force_released, "placement.force_released", _forced(uuid.uuid4()))
