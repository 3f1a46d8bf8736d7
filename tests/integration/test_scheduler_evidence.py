"""Readiness evidence from the bus into the scheduler, over real Postgres: the node agent's parity and
topology reports and the image pipeline's cache changes, each driven through the scheduler's own bus
handlers, and their effect on `allocation.accepted` placement (also through its handler, answer read
from the outbox)."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from gpuaas_common.bus import HandlerContext
from gpuaas_common.bus import deliver as bus_deliver
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.catalog import spec_for
from gpuaas_common.contract.envelope import Envelope
from gpuaas_common.jetstream import CONSUMER_BY_NAME
from gpuaas_common.outbox import EventCollector
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.service_layer import admin
from gpuaas_scheduler.service_layer.handlers import (
    EVIDENCE_CONSUMERS,
    Scheduler,
    evidence_handlers,
)
from gpuaas_scheduler.service_layer.placement import PlacementPolicy

from .scheduler_db import scheduler_pool

DIGEST = "a" * 64
OLD_DIGEST = "b" * 64
T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db, max_size=2) as p:
        yield p


@pytest.fixture
def scheduler():
    return Scheduler(PlacementPolicy())


async def deliver(pool, scheduler: Scheduler, type_: str, payload, *, occurred_at: datetime | None = None) -> None:
    """One message through the handler the scheduler subscribes for it, in one transaction as the bus runs it."""
    durable = next(d for d, t in EVIDENCE_CONSUMERS.items() if t == type_)
    handler = evidence_handlers(scheduler)[durable][type_]
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="test")
    if occurred_at is not None:
        env = env.model_copy(update={"occurred_at": occurred_at})
    assert await bus_deliver(
        handler,
        HandlerContext(env, payload, spec_for(type_).address, durable, 1),
        UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories),
    )


async def place(pool, scheduler: Scheduler, *, gpus=1, slug="img", digest=DIGEST) -> tuple[str, dict]:
    """`allocation.accepted` through the scheduler's handler; the answer as the outbox holds it."""
    ev = m.AllocationAccepted(
        allocation_id=uuid.uuid4(),
        tenant_id="t1",
        shape="gpu_slice",
        state="accepted",
        seq=2,
        sku="h200-sxm-slice",
        gpu_count=gpus,
        region="default",
        image=m.ImageRef(slug=slug, digest_sha256=digest, image_path="/img"),
    )
    env = Envelope.wrap("allocation.accepted", ev.model_dump(mode="json"), producer="test", correlation_id="test")
    ctx = HandlerContext(env, ev, "gpuaas.allocation.event.accepted", "scheduler-allocation-events", 1)
    assert await bus_deliver(
        scheduler.on_accepted, ctx, UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories)
    )
    body = await pool.fetchval("SELECT body FROM outbox WHERE aggregate_id = $1", str(ev.allocation_id))
    out = json.loads(body)
    return out["type"], out["payload"]


def parity(node_id: str, failures: int, at: datetime) -> m.NodeParityReported:
    checks = [m.ParityCheck(check="iommu", status="PASS", detail="IOMMU groups isolate each GPU")]
    checks += [
        m.ParityCheck(check=f"vfio_{i}", status="FAIL", detail="GPU not bound to vfio-pci", remediation="bind it")
        for i in range(failures)
    ]
    return m.NodeParityReported(node_id=node_id, checked_at=at, checks=checks, failures=failures, warnings=0)


def cache(node_id: str, status: str, digest: str | None, slug="img") -> m.ImageNodeCacheChanged:
    return m.ImageNodeCacheChanged(
        node_id=node_id,
        slug=slug,
        status=status,
        digest_sha256=digest,
        schedulable=status == "verified" and digest == DIGEST,
    )


def test_each_evidence_consumer_is_declared_on_its_subject():
    for durable, type_ in EVIDENCE_CONSUMERS.items():
        spec = CONSUMER_BY_NAME[durable]
        subject = spec_for(type_).address.replace("{node_id}", "*")
        assert spec.filter_subject == subject, durable


async def test_parity_failures_filter_the_host_and_a_clean_report_makes_it_placeable(pool, scheduler):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)

    await deliver(pool, scheduler, "node.parity_reported", parity("n00001", 2, T0))
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT parity_failures, parity_checked_at, parity_detail FROM nodes")
    assert row["parity_failures"] == 2 and row["parity_checked_at"] == T0
    assert [c["status"] for c in json.loads(row["parity_detail"])["checks"]] == ["PASS", "FAIL", "FAIL"]
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.unschedulable"
    assert answer["filtered"] == {"parity": 1} and answer["reason_code"] == "no_eligible_node"
    assert "without parity failures=0" in answer["reason"]

    await deliver(pool, scheduler, "node.parity_reported", parity("n00001", 0, T0 + timedelta(minutes=5)))
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.placed" and answer["node_id"] == "n00001"

    # A late redelivery of an older failing report cannot roll the evidence back.
    await deliver(pool, scheduler, "node.parity_reported", parity("n00001", 3, T0 + timedelta(minutes=1)))
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.placed" and answer["node_id"] == "n00001"


async def test_parity_of_an_unknown_node_is_ignored(pool, scheduler):
    await deliver(pool, scheduler, "node.parity_reported", parity("ghost", 0, T0))
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM nodes") == 0


def topology(node_id: str, gpus: list[int], at: datetime, *, mounted_disk: int | None = None) -> m.NodeTopologyReported:
    nvme, cands = [], []
    for i in gpus:
        by_id = f"/dev/disk/by-id/nvme-eui.{i:032x}"
        nvme.append(
            m.NvmeDevice(
                kernel_name=f"nvme{i}n1",
                by_id=by_id,
                size_bytes=3_840_000_000_000,
                numa_node=0,
                mounted=i == mounted_disk,
                is_os_disk=False,
                signatures=[],
                candidate=True,
            )
        )
        cands.append(
            m.CandidateSlot(
                index=i,
                gpu_pci_address=f"0000:{0x18 + i:02x}:00.0",
                numa_node=0,
                pcie_switch=f"sw{i // 2}",
                nvme_by_id=by_id,
                fabric_vf_pci_address=f"0000:29:00.{i % 8}",
                mac=f"52:54:00:00:01:{i:02x}",
                private_ip=f"10.100.0.{10 + i}",
                ovs_bridge="ovsbr0",
                ovs_port=f"vf{i}",
                complete=True,
            )
        )
    return m.NodeTopologyReported(node_id=node_id, discovered_at=at, nvme=nvme, candidate_slots=cands)


async def test_topology_is_stored_as_candidates_never_as_slots(pool, scheduler):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, slots_per_host=0)

    await deliver(pool, scheduler, "node.topology_reported", topology("n00001", [0, 1, 2], T0))
    async with pool.acquire() as conn:
        cands = await conn.fetch("SELECT * FROM candidate_slots ORDER BY candidate_id")
        assert await conn.fetchval("SELECT count(*) FROM node_resource_slots") == 0
    assert [c["gpu_pci_address"] for c in cands] == ["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"]
    assert {c["source"] for c in cands} == {"node-agent"} and {c["approved_slot_id"] for c in cands} == {None}
    assert json.loads(cands[0]["nvme_evidence"]) == {
        "mounted": False,
        "mounted_children": [],
        "signatures": [],
        "is_os_disk": False,
    }
    # Advisory only: nothing became placeable.
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.unschedulable" and answer["free_gpus"] == 0

    # An operator approves one candidate; the next discovery replaces only the unapproved ones.
    async with pool.acquire() as conn, conn.transaction():
        body = admin.ApproveIn(actor="ops@example", candidate_ids=[cands[0]["candidate_id"]])
        await admin.approve(conn, "n00001", body, events=EventCollector("scheduler"))
    await deliver(
        pool, scheduler, "node.topology_reported", topology("n00001", [0, 3], T0 + timedelta(minutes=5), mounted_disk=0)
    )
    async with pool.acquire() as conn:
        after = await conn.fetch("SELECT * FROM candidate_slots ORDER BY candidate_id")
    assert [(c["gpu_pci_address"], c["approved_slot_id"] is not None) for c in after] == [
        ("0000:18:00.0", True),
        ("0000:1b:00.0", False),
    ]
    # The approved candidate kept the evidence it was approved on, not the newer report's.
    assert json.loads(after[0]["nvme_evidence"])["mounted"] is False

    # A stale redelivery of the first report changes nothing.
    await deliver(pool, scheduler, "node.topology_reported", topology("n00001", [0, 1, 2], T0))
    async with pool.acquire() as conn:
        assert [
            c["gpu_pci_address"]
            for c in await conn.fetch("SELECT gpu_pci_address FROM candidate_slots ORDER BY candidate_id")
        ] == ["0000:18:00.0", "0000:1b:00.0"]


async def test_slices_need_the_image_verified_with_the_requested_digest(pool, scheduler):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=2)

    await deliver(pool, scheduler, "image.node_cache_changed", cache("n00001", "verified", OLD_DIGEST))
    await deliver(pool, scheduler, "image.node_cache_changed", cache("n00002", "pulling", None))
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.unschedulable"
    assert answer["filtered"] == {"image_cache": 2} and answer["reason_code"] == "no_eligible_node"
    assert "2 without the image verified in cache" in answer["reason"]

    await deliver(pool, scheduler, "image.node_cache_changed", cache("n00002", "verified", DIGEST))
    for _ in range(3):  # the multi-slot path and the single-slot path both gate: only n00002 is used
        kind, answer = await place(pool, scheduler, gpus=2)
        assert kind == "placement.placed" and answer["node_id"] == "n00002"
    kind, answer = await place(pool, scheduler, gpus=4)
    assert kind == "placement.unschedulable" and answer["filtered"]["image_cache"] == 1

    # Losing the cache takes the host out again; an older event arriving late does not bring it back.
    now = datetime.now(timezone.utc)
    await deliver(
        pool,
        scheduler,
        "image.node_cache_changed",
        cache("n00002", "failed", None),
        occurred_at=now + timedelta(minutes=1),
    )
    await deliver(pool, scheduler, "image.node_cache_changed", cache("n00002", "verified", DIGEST), occurred_at=now)
    kind, answer = await place(pool, scheduler)
    assert kind == "placement.unschedulable" and answer["filtered"] == {"image_cache": 2}


async def test_images_never_reported_by_the_prewarm_pipeline_stay_placeable(pool, scheduler):
    """The seed images predate the prewarm pipeline: copied into each host's cache, never reported."""
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    await deliver(pool, scheduler, "image.node_cache_changed", cache("n00001", "pulling", None, slug="other"))
    kind, answer = await place(pool, scheduler, slug="seed-image", digest=OLD_DIGEST)
    assert kind == "placement.placed" and answer["node_id"] == "n00001"
    kind, answer = await place(pool, scheduler, slug="other")
    assert kind == "placement.unschedulable" and answer["filtered"] == {"image_cache": 1}
