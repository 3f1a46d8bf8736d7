"""What /metrics reads from a service's own tables at scrape time, on real Postgres: allocations by state with the
oldest in each, the time an allocation spent in a state (observed as it leaves it), the outbox's depth and oldest
row, and the MAAS operations whose outcome is unknown with their deadline."""

from __future__ import annotations

import math
import uuid

import asyncpg
from prometheus_client import REGISTRY

from gpuaas_allocator.adapters.metrics import allocations_reading
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.metrics import Sample, outbox_reading
from gpuaas_common.migrations import apply_migrations
from gpuaas_maas_gateway.adapters.metrics import operations_reading

from .allocator_db import allocator_offering, pool, requested, send  # noqa: F401 (fixture)


def _by(samples: list[Sample], name: str) -> dict[tuple[str, ...], float]:
    return {s.values: s.value for s in samples if s.family.name == name}


def _observed(shape: str, state: str) -> tuple[float, float]:
    labels = {"shape": shape, "state": state}
    count = REGISTRY.get_sample_value("gpuaas_allocation_state_seconds_count", labels) or 0.0
    total = REGISTRY.get_sample_value("gpuaas_allocation_state_seconds_sum", labels) or 0.0
    return count, total


async def test_allocations_by_state_and_the_time_each_spent_in_a_state(pool) -> None:  # noqa: F811
    allocator = await allocator_offering(pool)
    count_before, sum_before = _observed("gpu_slice", "accepted")
    alloc = await requested(pool, allocator)
    # It entered `accepted` 90 s ago, as far as its timeline says.
    await pool.execute("UPDATE allocation_timeline SET at = at - interval '90 seconds' WHERE allocation_id = $1", alloc)
    samples = list(await allocations_reading(pool)())
    assert _by(samples, "gpuaas_allocations")[("accepted", "gpu_slice")] == 1
    assert _by(samples, "gpuaas_allocations")[("active", "baremetal")] == 0, "every pair is sampled"
    assert 90 <= _by(samples, "gpuaas_allocation_oldest_in_state_seconds")[("accepted", "gpu_slice")] < 150

    await _place(pool, allocator, alloc)
    count, total = _observed("gpu_slice", "accepted")
    assert count == count_before + 1
    assert 90 <= total - sum_before < 150, "from the timeline's move into the state to the move out"
    samples = list(await allocations_reading(pool)())
    assert _by(samples, "gpuaas_allocations")[("accepted", "gpu_slice")] == 0
    assert _by(samples, "gpuaas_allocations")[("provisioning", "gpu_slice")] == 1
    assert _by(samples, "gpuaas_allocation_oldest_in_state_seconds")[("accepted", "gpu_slice")] == 0


async def _place(pool: asyncpg.Pool, allocator, alloc: uuid.UUID) -> None:  # noqa: F811
    slot = m.SlotBinding(
        slot_id=f"n1-{alloc.hex[:6]}",
        gpu_pci_address="0000:18:00.0",
        nvme_by_id="nvme-x",
        fabric_vf_pci_address="0000:19:00.2",
        mac="52:54:00:00:00:01",
        private_ip="127.100.0.10",
        ovs_bridge="br-slice",
        profile="h200-slice",
    )
    placed = m.PlacementPlaced(allocation_id=alloc, node_id="n1", claim_mode="slots", slots=[slot], fencing_epoch=1)
    await send(pool, allocator.on_placed, "placement.placed", placed)


async def test_the_outbox_reading_says_how_many_rows_wait_and_for_how_long(pool) -> None:  # noqa: F811
    read = outbox_reading(pool, "allocator")
    assert _by(list(await read()), "gpuaas_outbox_depth") == {("allocator",): 0}
    assert _by(list(await read()), "gpuaas_outbox_oldest_age_seconds") == {("allocator",): 0}
    await pool.execute(
        "INSERT INTO outbox (event_id, aggregate_id, subject, body, created_at) "
        "VALUES ('e1', 'a', 's', '\\x7b7d', now() - interval '75 seconds'), ('e2', 'a', 's', '\\x7b7d', now())"
    )
    samples = list(await read())
    assert _by(samples, "gpuaas_outbox_depth") == {("allocator",): 2}
    assert 75 <= _by(samples, "gpuaas_outbox_oldest_age_seconds")[("allocator",)] < 135


async def test_unknown_maas_outcomes_read_with_their_age_and_deadline(fresh_db: str) -> None:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "maas_gateway", "gpuaas_maas_gateway.migrations")
    await conn.close()
    gateway = await create_pool(fresh_db, "maas_gateway")
    try:
        read = operations_reading(gateway)
        samples = list(await read())
        assert _by(samples, "gpuaas_maas_unknown_outcome_deadline_seconds")[("deploy",)] == math.inf
        assert _by(samples, "gpuaas_maas_unknown_outcome_age_seconds")[("deploy",)] == 0
        await gateway.execute(
            "INSERT INTO maas_operations (operation_id, kind, site, system_id, node_id, state, unknown_since, "
            "deadline_at) VALUES "
            "('op1', 'deploy', 's', 'abc', 'bm1', 'unknown', now() - interval '10 minutes', "
            "now() + interval '4 minutes'), "
            "('op2', 'deploy', 's', 'def', 'bm2', 'succeeded', NULL, now())"
        )
        samples = list(await read())
        assert 180 < _by(samples, "gpuaas_maas_unknown_outcome_deadline_seconds")[("deploy",)] <= 240
        assert 600 <= _by(samples, "gpuaas_maas_unknown_outcome_age_seconds")[("deploy",)] < 660
        ops = _by(samples, "gpuaas_maas_operations")
        assert (ops[("deploy", "unknown")], ops[("deploy", "succeeded")], ops[("release", "failed")]) == (1, 1, 0)
    finally:
        await gateway.close()
