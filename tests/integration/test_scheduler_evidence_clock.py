"""A host's report dated in the future must not freeze its evidence (found by the bus fuzzer): before, one
failing parity report dated a year ahead made every honest report after it 'older', and the host stayed
out of placement for good."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.domain.evidence_clock import as_received

from .test_scheduler_evidence import deliver, parity, place, pool, scheduler  # noqa: F401 (fixtures)

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("reported", "taken"),
    [
        (NOW - timedelta(days=3), NOW - timedelta(days=3)),
        (NOW, NOW),
        (NOW + timedelta(seconds=1), NOW),
        (NOW + timedelta(days=365 * 70), NOW),
        (datetime(2026, 11, 23, 11, 0), datetime(2026, 11, 23, 11, 0, tzinfo=timezone.utc)),
    ],
)
def test_a_report_is_never_later_than_its_receipt(reported, taken):
    assert as_received(reported, NOW) == taken


async def test_a_report_from_the_future_does_not_shadow_the_honest_ones_after_it(pool, scheduler):  # noqa: F811
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    future = datetime.now(timezone.utc) + timedelta(days=365)
    await deliver(pool, scheduler, "node.parity_reported", parity("n00001", 2, future))
    kind, _ = await place(pool, scheduler)
    assert kind == "placement.unschedulable"
    async with pool.acquire() as conn:
        stored = await conn.fetchval("SELECT parity_checked_at FROM nodes")
    assert stored <= datetime.now(timezone.utc)

    await deliver(pool, scheduler, "node.parity_reported", parity("n00001", 0, datetime.now(timezone.utc)))
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.placed" and answer["node_id"] == "n00001"
