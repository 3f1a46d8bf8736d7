"""Host drift from the node agent's reconciler, over real Postgres: `node.drift_reported` through the scheduler's
own bus handler, its effect on `allocation.accepted` placement (through its handler, the answer read from the
outbox), and ops acknowledging it through the admin API (Idempotency-Key, audit)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.service_layer.handlers import Scheduler
from gpuaas_scheduler.service_layer.placement import PlacementPolicy

from .scheduler_db import ADMIN_AUTH, admin_client, scheduler_pool
from .test_scheduler_evidence import deliver, place

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
NODE = "n00001"


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db, max_size=2) as p:
        async with p.acquire() as conn:
            await synthetic.build(conn, slice_hosts=1, slots_per_host=4)
        yield p


@pytest.fixture
def scheduler():
    return Scheduler(PlacementPolicy())


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


def report(at: datetime, *items: m.NodeDrift, node_id: str = NODE) -> m.NodeDriftReported:
    return m.NodeDriftReported(node_id=node_id, checked_at=at, drift=list(items))


def binding(slot: int) -> m.NodeDrift:
    """Named by device only, as the agent does for an override it never used: the scheduler finds the slot."""
    gpu = synthetic.slot_row(NODE, 1, slot)["gpu_pci_address"]
    return m.NodeDrift(kind="device_binding", subject=gpu, detail="bound to nvidia", devices=[gpu])


def dirty_disk(slot: int) -> m.NodeDrift:
    row = synthetic.slot_row(NODE, 1, slot)
    return m.NodeDrift(
        kind="disk_dirty",
        subject=row["nvme_by_id"],
        detail="idle slot disk carries dos (wipefs)",
        slot_ids=[row["slot_id"]],
        devices=[row["nvme_by_id"]],
    )


UNMANAGED = m.NodeDrift(kind="domain_unmanaged", subject="stray-vm", detail="no task record")


async def free_slots(pool) -> int:
    async with pool.acquire() as conn:
        return await conn.fetchval("SELECT free_slots FROM nodes WHERE node_id = $1", NODE)


async def drift_rows(pool) -> list[tuple]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT kind, slot_id, status FROM node_drift WHERE node_id = $1 ORDER BY kind, slot_id", NODE
        )
    return [tuple(r) for r in rows]


async def test_slot_drift_keeps_that_slot_out_and_a_clean_report_puts_it_back(pool, scheduler):
    await deliver(pool, scheduler, "node.drift_reported", report(T0, binding(0), dirty_disk(1)))
    assert await drift_rows(pool) == [("device_binding", f"{NODE}-s0", "open"), ("disk_dirty", f"{NODE}-s1", "open")]
    assert await free_slots(pool) == 2
    # Four GPUs would fit but for the drifted slots: the why-not says so.
    kind, answer = await place(pool, scheduler, gpus=4)
    assert kind == "placement.unschedulable"
    assert answer["filtered"] == {"drift_reported": 1}
    assert "with open drift reported by the node agent" in answer["reason"]
    # Two still fit, on the clean slots only.
    kind, answer = await place(pool, scheduler, gpus=2)
    assert kind == "placement.placed"
    assert sorted(s["slot_id"] for s in answer["slots"]) == [f"{NODE}-s2", f"{NODE}-s3"]

    # The next report no longer names the binding: resolved, the slot is free again; the disk stays open.
    await deliver(pool, scheduler, "node.drift_reported", report(T0 + timedelta(minutes=5), dirty_disk(1)))
    assert await drift_rows(pool) == [
        ("device_binding", f"{NODE}-s0", "resolved"),
        ("disk_dirty", f"{NODE}-s1", "open"),
    ]
    kind, answer = await place(pool, scheduler, gpus=1)
    assert kind == "placement.placed" and [s["slot_id"] for s in answer["slots"]] == [f"{NODE}-s0"]

    # A late redelivery of the first report cannot reopen what the newer one resolved.
    await deliver(pool, scheduler, "node.drift_reported", report(T0 + timedelta(minutes=1), binding(0)))
    assert ("device_binding", f"{NODE}-s0", "open") not in await drift_rows(pool)

    # An empty report: the host is clean.
    await deliver(pool, scheduler, "node.drift_reported", report(T0 + timedelta(minutes=10)))
    assert {r[2] for r in await drift_rows(pool)} == {"resolved"}
    kind, answer = await place(pool, scheduler, gpus=1)
    assert kind == "placement.placed" and [s["slot_id"] for s in answer["slots"]] == [f"{NODE}-s1"]


async def test_node_drift_keeps_the_node_out_until_ops_acknowledge(pool, scheduler, api):
    swept = m.NodeDrift(kind="dhcp_reservation_orphaned", subject="gpuaas-old", detail="released", swept=True)
    await deliver(pool, scheduler, "node.drift_reported", report(T0, UNMANAGED, swept))
    # The swept orphan is evidence only: kept in the report log, not as standing drift.
    assert await drift_rows(pool) == [("domain_unmanaged", None, "open")]
    async with pool.acquire() as conn:
        logged = await conn.fetchval("SELECT drift FROM node_drift_reports WHERE node_id = $1", NODE)
    assert "gpuaas-old" in logged
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.unschedulable" and answer["filtered"] == {"drift_reported": 1}
    assert answer["reason_code"] == "no_eligible_node"

    listed = await api.get(f"/v1/nodes/{NODE}/drift", headers=ADMIN_AUTH)
    body = await listed.json()
    assert listed.status == 200 and body["drift_open"] is True
    assert [(d["kind"], d["slot_id"], d["status"]) for d in body["drift"]] == [("domain_unmanaged", None, "open")]

    headers = {**ADMIN_AUTH, "Idempotency-Key": "ack-1", "X-Actor": "alice@example"}
    ack = {"actor": "alice", "reason": "stray-vm is the vendor's burn-in VM, holds no GPU"}
    resp = await api.post(f"/v1/nodes/{NODE}/drift/ack", json=ack, headers=headers)
    body = await resp.json()
    assert resp.status == 200, body
    assert body["drift_open"] is False and [d["status"] for d in body["drift"]] == ["acknowledged"]
    assert len(body["acknowledged"]) == 1
    # Replayed under its key: the same answer, acknowledged once.
    again = await api.post(f"/v1/nodes/{NODE}/drift/ack", json=ack, headers=headers)
    assert again.status == 200 and (await again.json()) == body
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.placed"
    async with pool.acquire() as conn:
        audit = await conn.fetch(
            "SELECT actor, action, target, reason FROM admin_audit WHERE action = 'node.drift_ack'"
        )
    assert [tuple(r) for r in audit] == [("alice", "node.drift_ack", NODE, ack["reason"])]

    # Still reported: stays acknowledged. A new item opens and blocks again.
    await deliver(pool, scheduler, "node.drift_reported", report(T0 + timedelta(minutes=5), UNMANAGED))
    assert await drift_rows(pool) == [("domain_unmanaged", None, "acknowledged")]
    other = m.NodeDrift(kind="domain_unmanaged", subject="another-vm", detail="no task record")
    await deliver(pool, scheduler, "node.drift_reported", report(T0 + timedelta(minutes=10), UNMANAGED, other))
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.unschedulable" and answer["filtered"] == {"drift_reported": 1}


async def test_acknowledging_named_drift_is_all_or_nothing(pool, scheduler, api):
    await deliver(pool, scheduler, "node.drift_reported", report(T0, binding(0), dirty_disk(1)))
    async with pool.acquire() as conn:
        ids = {r["kind"]: r["drift_id"] for r in await conn.fetch("SELECT kind, drift_id FROM node_drift")}
    h = lambda key: {**ADMIN_AUTH, "Idempotency-Key": key}  # noqa: E731
    body = {"actor": "ops", "reason": "checked"}
    missing = await api.post(
        f"/v1/nodes/{NODE}/drift/ack", json={**body, "drift_ids": [ids["disk_dirty"], 999999]}, headers=h("a")
    )
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "drift_not_found"
    assert {r[2] for r in await drift_rows(pool)} == {"open"}
    one = await api.post(f"/v1/nodes/{NODE}/drift/ack", json={**body, "drift_ids": [ids["disk_dirty"]]}, headers=h("b"))
    assert one.status == 200
    assert await drift_rows(pool) == [
        ("device_binding", f"{NODE}-s0", "open"),
        ("disk_dirty", f"{NODE}-s1", "acknowledged"),
    ]
    assert await free_slots(pool) == 3
    twice = await api.post(
        f"/v1/nodes/{NODE}/drift/ack", json={**body, "drift_ids": [ids["disk_dirty"]]}, headers=h("c")
    )
    assert twice.status == 409 and (await twice.json())["error"]["code"] == "drift_not_open"
    rest = await api.post(f"/v1/nodes/{NODE}/drift/ack", json=body, headers=h("d"))
    assert rest.status == 200 and await free_slots(pool) == 4
    none_left = await api.post(f"/v1/nodes/{NODE}/drift/ack", json=body, headers=h("e"))
    assert none_left.status == 409 and (await none_left.json())["error"]["code"] == "no_open_drift"
    unknown = await api.get("/v1/nodes/ghost/drift", headers=ADMIN_AUTH)
    assert unknown.status == 404


async def test_drift_of_an_unknown_node_is_ignored(pool, scheduler):
    await deliver(pool, scheduler, "node.drift_reported", report(T0, UNMANAGED, node_id="ghost"))
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM node_drift") == 0
        assert await conn.fetchval("SELECT count(*) FROM node_drift_reports") == 0


async def test_a_hosts_drift_reports_stay_at_the_cap_as_each_one_is_written(pool):
    """Each applied report is kept as evidence, but a host keeps only its newest `drift_reports_kept` right after
    each one, whatever the hourly sweep has not yet done."""
    capped = Scheduler(PlacementPolicy(), drift_reports_kept=3)
    sent: list[datetime] = []
    for i in range(5):
        at = T0 + timedelta(minutes=i)
        await deliver(pool, capped, "node.drift_reported", report(at, dirty_disk(1)))
        sent.append(at)
        async with pool.acquire() as conn:
            kept = await conn.fetch(
                "SELECT checked_at FROM node_drift_reports WHERE node_id = $1 ORDER BY checked_at", NODE
            )
        assert [r["checked_at"] for r in kept] == sent[-3:], f"after report {i}"
