"""The ops read models (services/ops-view) against a real nats-server and Postgres: they follow the streams
live, answer the ops API with filters and pages, dead-letter what they cannot place and keep following, and a
follower started on an empty schema rebuilds every model from the streams to the same rows as the live one."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import asyncpg
import nats
import pytest
from pydantic import BaseModel, SecretStr

from gpuaas_common.bus import Bus, parse_message
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.jetstream import FOLLOWERS
from gpuaas_common.migrations import apply_migrations
from gpuaas_dev.testing.waiting import eventually
from gpuaas_ops_view.entrypoints.admin_http import ops_api
from gpuaas_ops_view.entrypoints.follow import StreamFollower

from ..bounded import bounded

TOKEN = "ops-view-test-token-0123456789"
# The billing principal's: the usage records and nothing else.
BILLING_TOKEN = "ops-view-billing-token-0123456789"
SCHEMA = "ops_view"
MODEL_TABLES = (
    "allocations",
    "allocation_timeline",
    "claims",
    "forced_releases",
    "node_tasks",
    "node_task_phases",
    "hosts",
    "slots",
    "images",
    "image_caches",
    "maas_operations",
    "dead_letters",
    "audit_records",
    "host_mode_history",
    "stream_positions",
)
SHA = "a" * 64


@dataclass
class View:
    """A follower set on one database, with its ops API."""

    pool: asyncpg.Pool
    tasks: list[asyncio.Task[None]]
    followers: list[StreamFollower]
    url: str
    stop_api: Any

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()


async def _start_view(nc: nats.NATS, dsn: str, prefix: str) -> View:
    conn = await asyncpg.connect(dsn)
    await apply_migrations(conn, SCHEMA, "gpuaas_ops_view.migrations")
    await conn.close()
    pool = await create_pool(dsn, SCHEMA)
    js = nc.jetstream()
    letters = Bus(nc, js, service="ops-view", schema=None, pool=None)
    followers = [
        StreamFollower(
            nc, js, pool, spec, name=spec.durable.replace("ops-view", prefix, 1), dead_letters=letters, batch=64
        )
        for spec in FOLLOWERS
    ]
    tasks = [asyncio.create_task(f.run()) for f in followers]

    async def consumer_state() -> dict[str, tuple[int, int] | None]:
        out: dict[str, tuple[int, int] | None] = {}
        for f in followers:
            try:
                info = await js.consumer_info(f.stream, f.spec.durable)
                out[f.stream] = (info.num_pending or 0, info.delivered.stream_seq or 0)
            except nats.errors.Error:
                out[f.stream] = None
        return out

    api = ops_api(pool, SecretStr(TOKEN), consumer_state, billing_token=SecretStr(BILLING_TOKEN))
    port = await api.start("127.0.0.1", 0)
    return View(pool, tasks, followers, f"http://127.0.0.1:{port}", api.stop)


async def _close(view: View) -> None:
    await view.stop()
    await view.stop_api()
    await view.pool.close()


@pytest.fixture
async def nc(nats_server) -> AsyncIterator[nats.NATS]:
    client = await nats.connect(nats_server.url)
    from gpuaas_common.jetstream import provision

    await provision(client.jetstream())
    yield client
    await bounded("the connection drains", client.drain())


@pytest.fixture
async def view(nc: nats.NATS, fresh_db: str) -> AsyncIterator[View]:
    v = await _start_view(nc, fresh_db, f"ov-{uuid.uuid4().hex[:8]}")
    yield v
    await _close(v)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
        yield session


async def publish(nc: nats.NATS, type_: str, payload: BaseModel, **params: str) -> str:
    """Publish one event as its producer would, checked against the contract first."""
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id=str(uuid.uuid4()))
    subject = spec_for(type_).subject(**params)
    body = env.model_dump_json().encode()
    parse_message(subject, body)
    ack = await nc.jetstream().publish(subject, body, headers={"Nats-Msg-Id": env.event_id})
    assert ack.stream
    return env.event_id


async def get(http: aiohttp.ClientSession, url: str, **query: str) -> tuple[int, Any]:
    async with http.get(url, params=query) as resp:
        return resp.status, await resp.json()


async def caught_up(http: aiohttp.ClientSession, view: View, timeout: float = 20.0) -> None:
    """Until every followed stream has nothing pending and everything delivered committed (polled: the models
    publish no event of their own to wait on)."""

    async def all_caught_up() -> bool:
        status, body = await get(http, f"{view.url}/v1/streams")
        assert status == 200, body
        return all(item["caught_up"] for item in body["items"])

    await eventually(all_caught_up, timeout, what="every stream caught up")


def _slot(node: str, i: int) -> m.SlotBinding:
    return m.SlotBinding(
        slot_id=f"{node}-s{i}",
        gpu_pci_address=f"0000:1{i}:00.0",
        nvme_by_id=f"/dev/disk/by-id/nvme-eui.{i:016x}",
        fabric_vf_pci_address=None,
        mac=f"52:54:00:00:00:0{i}",
        private_ip=f"10.100.0.{10 + i}",
        ovs_bridge="ovsbr0",
        profile="h200_1g",
    )


async def lifecycle(nc: nats.NATS, alloc: uuid.UUID, tenant: str, node: str, *, upto: str = "active") -> None:
    """One slice allocation's events as the allocator, the scheduler and a host send them."""
    base = {"allocation_id": alloc, "tenant_id": tenant, "shape": "gpu_slice"}
    image = m.ImageRef(slug="debian-12", digest_sha256=SHA, image_path="/var/lib/gpuaas/images/debian-12.raw")
    await publish(
        nc,
        "allocation.accepted",
        m.AllocationAccepted(
            **base, state="accepted", seq=1, sku="h200-sxm-slice", gpu_count=2, region="default", image=image
        ),
    )
    slots = [_slot(node, 1), _slot(node, 2)]
    await publish(
        nc,
        "allocation.placed",
        m.AllocationPlaced(
            **base, state="placed", previous_state="accepted", seq=2, node_id=node, claim_mode="slots", slots=slots
        ),
    )
    if upto == "placed":
        return
    task = f"t-{alloc.hex[:12]}"
    await publish(
        nc,
        "allocation.provisioning",
        m.AllocationProvisioning(
            **base, state="provisioning", previous_state="placed", seq=3, node_id=node, task_id=task
        ),
    )
    await publish(
        nc,
        "slice.vm_provision",
        m.SliceVmProvision(
            task_id=task,
            allocation_id=alloc,
            node_id=node,
            fencing_epoch=1,
            deadline=datetime.now(timezone.utc) + timedelta(minutes=10),
            vm_name=f"vm-{alloc.hex[:8]}",
            slots=slots,
            image=image,
            hostname="box",
        ),
        node_id=node,
    )
    for phase in ("preflight", "clone", "boot", "ssh"):
        await publish(
            nc,
            "node.task_progress",
            m.NodeTaskProgress(
                task_id=task, allocation_id=alloc, node_id=node, task_type="slice.vm_provision", phase=phase
            ),
            node_id=node,
        )
    await publish(
        nc,
        "node.task_result",
        m.NodeTaskResult(
            task_id=task, allocation_id=alloc, node_id=node, task_type="slice.vm_provision", status="succeeded"
        ),
        node_id=node,
    )
    await publish(
        nc,
        "allocation.active",
        m.AllocationActive(
            **base,
            state="active",
            previous_state="provisioning",
            seq=4,
            node_id=node,
            access=m.AccessInfo(ip="10.100.0.11", ssh_ready=True),
        ),
    )


def admin_request(
    node: str, reason: str, *, actor: str = "alice@ops", status: int = 200
) -> m.SchedulerAdminRequestRecorded:
    """The audit record the scheduler's admin API publishes for a drain."""
    return m.SchedulerAdminRequestRecorded(
        service="scheduler",
        request_id=f"req-{uuid.uuid4().hex[:12]}",
        principal="admin",
        actor=actor,
        method="POST",
        path=f"/v1/nodes/{node}/drain",
        status=status,
        error_code=None if status < 400 else "node_not_found",
        idempotency_key=uuid.uuid4().hex,
        reason=reason,
        body_sha256=SHA,
    )


def mode_change(node: str, from_mode: str, to_mode: str) -> m.HostModeChanged:
    """What the scheduler announces when ops move a host."""
    return m.HostModeChanged(
        node_id=node,
        from_mode=from_mode,  # type: ignore[arg-type]
        to_mode=to_mode,  # type: ignore[arg-type]
        actor="alice@ops",
        reason="chassis returned",
        changed_at=datetime.now(timezone.utc),
    )


def slots_changed(node: str, generation: int, **slots: tuple[str, str, str | None]) -> m.SlotsChanged:
    """What the scheduler announces of a host's slots: slot number -> (status, health, why)."""
    return m.SlotsChanged(
        node_id=node,
        generation=generation,
        cause="repair",
        actor="alice@ops",
        slots=[
            m.SlotState(
                slot_id=f"{node}-{i}",
                status=status,  # type: ignore[arg-type]
                status_reason=why,
                health_state=health,  # type: ignore[arg-type]
                health_detail=why if health != "healthy" else None,
                profile="h200_1g",
                gpu_pci_address=f"0000:1{i[1:]}:00.0",
                nvme_by_id=f"/dev/disk/by-id/nvme-eui.{int(i[1:]):016x}",
                private_ip=f"10.100.0.{10 + int(i[1:])}",
                updated_at=datetime.now(timezone.utc),
            )
            for i, (status, health, why) in sorted(slots.items())
        ],
    )


async def fleet(nc: nats.NATS, node: str) -> None:
    now = datetime.now(timezone.utc)
    await publish(
        nc,
        "node.enrolled",
        m.NodeEnrolled(node_id=node, kind="slice_host", hostname=f"{node}.lab", agent_version="1.0"),
        node_id=node,
    )
    await publish(
        nc,
        "node.parity_reported",
        m.NodeParityReported(
            node_id=node,
            checked_at=now,
            failures=1,
            warnings=1,
            checks=[
                m.ParityCheck(check="kvm", status="PASS", detail="ok"),
                m.ParityCheck(check="ovs_bridge", status="FAIL", detail="ovsbr0 missing"),
                m.ParityCheck(check="bf3_peer", status="WARN", detail="no answer"),
            ],
        ),
        node_id=node,
    )
    await publish(
        nc,
        "node.drift_reported",
        m.NodeDriftReported(
            node_id=node,
            checked_at=now,
            drift=[
                m.NodeDrift(
                    kind="device_binding", subject="0000:12:00.0", detail="bound to nvidia", slot_ids=[f"{node}-s2"]
                )
            ],
        ),
        node_id=node,
    )


async def test_models_follow_the_streams_live(nc: nats.NATS, view: View, http: aiohttp.ClientSession) -> None:
    alloc, node, tenant = uuid.uuid4(), f"n-{uuid.uuid4().hex[:8]}", f"tenant-{uuid.uuid4().hex[:6]}"
    await fleet(nc, node)
    await lifecycle(nc, alloc, tenant, node)
    slug = f"img-{uuid.uuid4().hex[:8]}"
    await publish(
        nc,
        "image.published",
        m.ImagePublished(slug=slug, build_id="b1", digest_sha256=SHA, source_uri="oci://r/x", image_path="/i/x.raw"),
    )
    await publish(
        nc,
        "image.node_cache_changed",
        m.ImageNodeCacheChanged(node_id=node, slug=slug, status="verified", digest_sha256=SHA, schedulable=True),
    )
    await publish(
        nc,
        "image.activated",
        m.ImageActivated(slug=slug, kind="slice", sku="h200-sxm-slice", digest_sha256=SHA, image_path="/i/x.raw"),
    )
    op = f"op-{uuid.uuid4().hex[:8]}"
    await publish(
        nc,
        "maas.deploy_requested",
        m.MaasDeployRequested(
            operation_id=op, allocation_id=alloc, site="s1", system_id="abc123", node_id=node, profile="bm"
        ),
    )
    await caught_up(http, view)

    status, a = await get(http, f"{view.url}/v1/allocations/{alloc}")
    assert status == 200, a
    assert (a["state"], a["tenant_id"], a["node_id"], a["gpu_count"], a["image"]) == (
        "active",
        tenant,
        node,
        2,
        "debian-12",
    )
    assert [t["state"] for t in a["timeline"]] == ["accepted", "placed", "provisioning", "active"]
    assert sorted(c["slot_id"] for c in a["claims"]) == [f"{node}-s1", f"{node}-s2"]
    assert all(c["released_at"] is None for c in a["claims"])
    [task] = a["tasks"]
    assert task["status"] == "succeeded" and task["task_type"] == "slice.vm_provision"
    assert [p["phase"] for p in task["phases"]] == ["preflight", "clone", "boot", "ssh"]

    status, h = await get(http, f"{view.url}/v1/hosts/{node}")
    assert status == 200, h
    assert (h["kind"], h["parity_failures"], h["parity_warnings"]) == ("slice_host", 1, 1)
    assert sorted(c["check"] for c in h["parity_failing"]) == ["bf3_peer", "ovs_bridge"]
    assert 0 <= h["evidence_age_s"]["parity"] < 60 and h["evidence_age_s"]["topology"] is None
    slots = {s["slot_id"]: s for s in h["slots"]}
    assert slots[f"{node}-s1"]["status"] == "held" and slots[f"{node}-s1"]["held_by"] == str(alloc)
    assert slots[f"{node}-s2"]["drift"] == ["device_binding"] and slots[f"{node}-s1"]["drift"] == []

    status, img = await get(http, f"{view.url}/v1/images/{slug}")
    assert (status, img["status"], img["kind"]) == (200, "active", "slice")
    assert [(c["node_id"], c["status"], c["schedulable"]) for c in img["caches"]] == [(node, "verified", True)]

    status, ops = await get(http, f"{view.url}/v1/maas/operations", status="in_flight", node=node)
    assert [o["operation_id"] for o in ops["items"]] == [op]
    await publish(
        nc,
        "maas.deploy_result",
        m.MaasDeployResult(
            operation_id=op,
            allocation_id=alloc,
            system_id="abc123",
            node_id=node,
            resolution="polled",
            attempts=1,
            status="deployed",
        ),
    )
    # The release: the claims end with the wipe proof, the slots are available again.
    base = {"allocation_id": alloc, "tenant_id": tenant, "shape": "gpu_slice"}
    await publish(nc, "allocation.releasing", m.AllocationReleasing(**base, state="releasing", seq=5))
    await publish(
        nc,
        "allocation.released",
        m.AllocationReleased(
            **base, state="released", seq=6, node_id=node, cleanup=m.CleanupReport(required=True, verified=True)
        ),
    )
    await caught_up(http, view)
    _, ops = await get(http, f"{view.url}/v1/maas/operations", node=node)
    assert [(o["status"], o["resolution"]) for o in ops["items"]] == [("deployed", "polled")]
    _, h = await get(http, f"{view.url}/v1/hosts/{node}")
    assert {s["status"] for s in h["slots"]} == {"available"} and h["claims"] == []
    _, a = await get(http, f"{view.url}/v1/allocations/{alloc}")
    assert a["state"] == "released" and {c["outcome"] for c in a["claims"]} == {"wiped"}


async def test_lag_behind_the_stream_is_small(nc: nats.NATS, view: View, http: aiohttp.ClientSession) -> None:
    """From publish to the row the API answers with, one event at a time at low load."""
    await caught_up(http, view)
    lags = []
    for _ in range(20):
        alloc = uuid.uuid4()
        start = time.monotonic()
        await publish(
            nc,
            "allocation.accepted",
            m.AllocationAccepted(
                allocation_id=alloc,
                tenant_id="lag",
                shape="gpu_slice",
                state="accepted",
                seq=1,
                sku="h200-sxm-slice",
                gpu_count=1,
                region="default",
                image=m.ImageRef(slug="debian-12", digest_sha256=SHA, image_path="/i"),
            ),
        )
        while (await get(http, f"{view.url}/v1/allocations/{alloc}"))[0] != 200:
            assert time.monotonic() - start < 10
        lags.append(time.monotonic() - start)
    lags.sort()
    print(f"ops-view publish-to-API lag: p50 {lags[10] * 1000:.1f} ms, max {lags[-1] * 1000:.1f} ms")
    assert lags[10] < 0.5, lags


async def test_filters_pages_and_bad_values(nc: nats.NATS, view: View, http: aiohttp.ClientSession) -> None:
    tenant_a, tenant_b = f"ta-{uuid.uuid4().hex[:6]}", f"tb-{uuid.uuid4().hex[:6]}"
    node = f"n-{uuid.uuid4().hex[:8]}"
    started = datetime.now(timezone.utc) - timedelta(seconds=1)
    a_ids = [uuid.uuid4() for _ in range(5)]
    for alloc in a_ids:
        await lifecycle(nc, alloc, tenant_a, node, upto="placed")
    b_id = uuid.uuid4()
    await lifecycle(nc, b_id, tenant_b, f"{node}-other")
    await caught_up(http, view)

    seen: list[str] = []
    cursor = None
    while True:
        q = {"tenant": tenant_a, "limit": "2", **({"cursor": cursor} if cursor else {})}
        status, page = await get(http, f"{view.url}/v1/allocations", **q)
        assert status == 200, page
        assert len(page["items"]) <= 2
        seen += [i["allocation_id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(map(str, a_ids)) and len(seen) == 5
    _, page = await get(http, f"{view.url}/v1/allocations", state="active", node=f"{node}-other")
    assert [i["allocation_id"] for i in page["items"]] == [str(b_id)]
    _, page = await get(http, f"{view.url}/v1/allocations", tenant=tenant_a, state="active")
    assert page["items"] == []
    _, page = await get(http, f"{view.url}/v1/allocations", tenant=tenant_b, since=started.isoformat())
    assert len(page["items"]) == 1
    _, page = await get(http, f"{view.url}/v1/allocations", tenant=tenant_b, until=started.isoformat())
    assert page["items"] == []

    for query, field in (
        ({"state": "bogus"}, "state"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-11-01T00:00:00"}, "since"),
        ({"since": "2026-11-02T00:00:00Z", "until": "2026-11-01T00:00:00Z"}, "until"),
        ({"limit": "0"}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"tenant": "no spaces"}, "tenant"),
        ({"node": "-x"}, "node"),
        ({"cursor": "not-a-cursor!"}, "cursor"),
    ):
        status, body = await get(http, f"{view.url}/v1/allocations", **query)
        assert status == 400, (query, body)
        assert body["error"]["code"] == "invalid_filter" and body["error"]["details"]["field"] == field, body
    status, body = await get(http, f"{view.url}/v1/allocations/not-a-uuid")
    assert (status, body["error"]["details"]["field"]) == (400, "allocation_id")
    status, body = await get(http, f"{view.url}/v1/maas/operations", status="lost")
    assert (status, body["error"]["details"]["field"]) == (400, "status")
    status, body = await get(http, f"{view.url}/v1/dead-letters", since="nope")
    assert (status, body["error"]["details"]["field"]) == (400, "since")
    status, _ = await get(http, f"{view.url}/v1/allocations/{uuid.uuid4()}")
    assert status == 404
    async with aiohttp.ClientSession() as anonymous:
        async with anonymous.get(f"{view.url}/v1/allocations") as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "unauthorized"
        async with anonymous.get(f"{view.url}/v1/dead-letters", headers={"Authorization": "Bearer wrong"}) as resp:
            assert resp.status == 401


async def test_an_unplaceable_event_is_dead_lettered_and_the_stream_still_followed(
    nc: nats.NATS, view: View, http: aiohttp.ClientSession
) -> None:
    alloc, node = uuid.uuid4(), f"n-{uuid.uuid4().hex[:8]}"
    await lifecycle(nc, alloc, "tenant-x", node, upto="placed")
    # Seq 2 again, with another state: the allocator never numbers two transitions alike.
    clash = await publish(
        nc,
        "allocation.failed",
        m.AllocationFailed(
            allocation_id=alloc,
            tenant_id="tenant-x",
            shape="gpu_slice",
            state="failed",
            seq=2,
            reason_code="x",
            reason="clash",
            cleanup_required=False,
        ),
    )
    # Not even JSON, on a lifecycle subject.
    await nc.jetstream().publish("gpuaas.allocation.event.active", b"{not json", headers={"Nats-Msg-Id": clash + "-x"})
    await publish(
        nc,
        "allocation.provisioning",
        m.AllocationProvisioning(
            allocation_id=alloc, tenant_id="tenant-x", shape="gpu_slice", state="provisioning", seq=3, node_id=node
        ),
    )
    await caught_up(http, view)
    _, a = await get(http, f"{view.url}/v1/allocations/{alloc}")
    assert a["state"] == "provisioning"
    assert [t["state"] for t in a["timeline"]] == ["accepted", "placed", "provisioning"]

    consumer = view.followers[0].spec.durable

    async def two_letters() -> dict | None:
        _, found = await get(http, f"{view.url}/v1/dead-letters", consumer=consumer)
        return found if len(found["items"]) >= 2 else None

    letters = await eventually(two_letters, 20, what="both bad events dead-lettered")
    reasons = {(d["reason_code"], d["origin_subject"]) for d in letters["items"]}
    assert reasons == {
        ("unplaceable", "gpuaas.allocation.event.failed"),
        ("not_json", "gpuaas.allocation.event.active"),
    }, letters
    assert any("already has 'placed' at seq 2" in d["reason"] for d in letters["items"])
    # The dead letters themselves are contract events.
    sub = await nc.jetstream().subscribe(f"gpuaas.dlq.{consumer}", ordered_consumer=True)
    for _ in range(2):
        msg = await sub.next_msg(timeout=5)
        env, payload = parse_message(msg.subject, msg.data)
        assert env.type == "dead_letter" and payload.consumer == consumer
    await sub.unsubscribe()


async def test_slots_health_and_never_placed_slots_come_from_the_schedulers_announcements(
    nc: nats.NATS, view: View, http: aiohttp.ClientSession
) -> None:
    alloc, node = uuid.uuid4(), f"n-{uuid.uuid4().hex[:8]}"
    healthy = ("available", "healthy", None)
    await publish(
        nc,
        "scheduler.slots_changed",
        slots_changed(
            node,
            2,
            s1=healthy,
            s2=healthy,
            s3=("disabled", "healthy", "nvme has mounted children"),
            s4=("cleanup_blocked", "failed", "no blkdiscard proof"),
        ),
    )
    # An older announcement read after the newer one changes nothing.
    gone = ("retired", "unknown", "stale")
    await publish(nc, "scheduler.slots_changed", slots_changed(node, 1, s1=gone, s3=gone, s4=gone, s5=gone))
    await lifecycle(nc, alloc, "tenant-h", node)
    await caught_up(http, view)

    status, h = await get(http, f"{view.url}/v1/hosts/{node}")
    assert status == 200, h
    assert h["slots_generation"] == 2
    slots = {s["slot_id"]: s for s in h["slots"]}
    assert sorted(slots) == [f"{node}-s{i}" for i in (1, 2, 3, 4)]  # s3 and s4 never placed; no s5
    view_of = {k: (s["status"], s["health_state"], s["status_reason"]) for k, s in slots.items()}
    assert view_of == {
        f"{node}-s1": ("held", "healthy", None),
        f"{node}-s2": ("held", "healthy", None),
        f"{node}-s3": ("disabled", "healthy", "nvme has mounted children"),
        f"{node}-s4": ("cleanup_blocked", "failed", "no blkdiscard proof"),
    }
    assert slots[f"{node}-s4"]["health_detail"] == "no blkdiscard proof"
    assert slots[f"{node}-s1"]["held_by"] == str(alloc) and slots[f"{node}-s3"]["held_by"] is None

    # Another event under a number already read is a broken history: dead-lettered, the model unchanged.
    clash = await publish(nc, "scheduler.slots_changed", slots_changed(node, 2, s1=gone))
    # The release (a verified wipe) gives the held slots back; then the scheduler blocks s1 (it refused the proof
    # the allocator took for good) and repairs s4.
    base = {"allocation_id": alloc, "tenant_id": "tenant-h", "shape": "gpu_slice"}
    await publish(
        nc,
        "allocation.released",
        m.AllocationReleased(
            **base, state="released", seq=5, node_id=node, cleanup=m.CleanupReport(required=True, verified=True)
        ),
    )
    await caught_up(http, view)
    _, h = await get(http, f"{view.url}/v1/hosts/{node}")
    assert {s["slot_id"]: s["status"] for s in h["slots"]}[f"{node}-s1"] == "available"
    await publish(
        nc,
        "scheduler.slots_changed",
        slots_changed(
            node,
            3,
            s1=("cleanup_blocked", "failed", "nvme_format proof, blkdiscard policy"),
            s2=healthy,
            s3=("disabled", "healthy", "nvme has mounted children"),
            s4=healthy,
        ),
    )
    await caught_up(http, view)
    _, h = await get(http, f"{view.url}/v1/hosts/{node}")
    assert {s["slot_id"]: (s["status"], s["health_state"]) for s in h["slots"]} == {
        f"{node}-s1": ("cleanup_blocked", "failed"),
        f"{node}-s2": ("available", "healthy"),
        f"{node}-s3": ("disabled", "healthy"),
        f"{node}-s4": ("available", "healthy"),
    }
    assert h["slots_generation"] == 3

    [scheduler] = [f for f in view.followers if f.stream == "SCHEDULER"]

    async def the_letter() -> dict | None:
        _, found = await get(http, f"{view.url}/v1/dead-letters", consumer=scheduler.spec.durable)
        mine = [d for d in found["items"] if node in d["reason"]]
        return mine[0] if mine else None

    letter = await eventually(the_letter, 20, what="the clashing announcement dead-lettered")
    assert letter["reason_code"] == "unplaceable" and letter["origin_subject"] == "gpuaas.scheduler.host.slots_changed"
    assert "already has announcement 2 from event" in letter["reason"] and clash in letter["reason"]


def wipe_report(task: m.SliceSlotWipe, *, refuse: str | None = None) -> m.NodeSlotWipeReported:
    """The host's answer to `task`: every slot proven wiped, but `refuse` (a slot id), which its agent refused."""
    outcomes = []
    for s in task.slots:
        if s.slot_id == refuse:
            outcomes.append(
                m.SlotWipeOutcome(
                    slot_id=s.slot_id, device=s.nvme_by_id, reason_code="disk_leased", reason="leased by a live VM"
                )
            )
            continue
        proof = m.WipeProof(device=s.nvme_by_id, method="blkdiscard", verified=True, verification="zeros read back")
        outcomes.append(m.SlotWipeOutcome(slot_id=s.slot_id, device=s.nvme_by_id, proof=proof))
    return m.NodeSlotWipeReported(task_id=task.task_id, node_id=task.node_id, outcomes=outcomes)


async def test_a_hosts_slot_wipes_are_on_its_timeline_with_each_slots_proof(
    nc: nats.NATS, view: View, http: aiohttp.ClientSession
) -> None:
    node = f"n-{uuid.uuid4().hex[:8]}"
    await fleet(nc, node)
    disks = {f"{node}-s{i}": f"/dev/disk/by-id/nvme-eui.{node}-{i}" for i in (1, 2)}
    tasks = [
        m.SliceSlotWipe(
            task_id=f"wipe-{node}-{n}",
            node_id=node,
            deadline=datetime.now(timezone.utc) + timedelta(minutes=10),
            slots=[m.WipeSlot(slot_id=k, nvme_by_id=v, wipe_policy="blkdiscard") for k, v in disks.items()],
        )
        for n in (1, 2)
    ]
    # The first: one disk refused by the host; the second, asked again, proves both.
    await publish(nc, "slice.slot_wipe", tasks[0], node_id=node)
    await publish(nc, "node.slot_wipe_reported", wipe_report(tasks[0], refuse=f"{node}-s2"), node_id=node)
    await publish(nc, "slice.slot_wipe", tasks[1], node_id=node)
    await publish(nc, "node.slot_wipe_reported", wipe_report(tasks[1]), node_id=node)
    await caught_up(http, view)

    status, h = await get(http, f"{view.url}/v1/hosts/{node}")
    assert status == 200, h
    wipes = {t["task_id"]: t for t in h["tasks"] if t["task_type"] == "slice.slot_wipe"}
    assert sorted(wipes) == sorted(t.task_id for t in tasks)
    first, second = wipes[tasks[0].task_id], wipes[tasks[1].task_id]
    assert (first["status"], first["reason_code"]) == ("failed", "wipe_not_proven"), first
    assert first["reason"] == f"no verified proof for {node}-s2" and first["sent_at"] and first["finished_at"]
    [said] = [p["detail"] for p in first["phases"] if p["phase"] == "wipe_reported"]
    assert said == (
        f"{node}-s1 {disks[f'{node}-s1']}: blkdiscard, verified; "
        f"{node}-s2 {disks[f'{node}-s2']}: refused (disk_leased): leased by a live VM"
    )
    assert (second["status"], second["reason_code"]) == ("succeeded", None), second
    [said] = [p["detail"] for p in second["phases"] if p["phase"] == "wipe_reported"]
    assert all(f"{k} {v}: blkdiscard, verified" in said for k, v in disks.items()), said
    # No allocation's timeline holds a host's wipe.
    assert all(t["allocation_id"] is None for t in h["tasks"])


async def _dump(pool: asyncpg.Pool) -> dict[str, list[tuple]]:
    out = {}
    async with pool.acquire() as conn:
        for table in MODEL_TABLES:
            rows = await conn.fetch(f"SELECT * FROM {table}")
            if table == "dead_letters":
                # Each follower dead-letters under its own consumer name: the letters are the same messages.
                rows = [r for r in rows if not r["consumer"].startswith("ov-")]
            out[table] = sorted(tuple(str(v) for v in r.values()) for r in rows)
    return out


async def test_replay_rebuilds_every_model_and_a_restart_resumes(
    nc: nats.NATS, view: View, http: aiohttp.ClientSession, postgres_server
) -> None:
    node = f"n-{uuid.uuid4().hex[:8]}"
    await fleet(nc, node)
    for i in range(3):
        await lifecycle(nc, uuid.uuid4(), f"t{i}", node, upto="active" if i else "placed")
    await publish(nc, "scheduler.admin_request_recorded", admin_request(node, "rack swap"))
    for frm, to in (("slice", "drained"), ("drained", "retired")):
        await publish(nc, "scheduler.host_mode_changed", mode_change(node, frm, to))
    # The host's slots as the scheduler announced them: one never placed and failed, then an older announcement.
    healthy = ("available", "healthy", None)
    await publish(
        nc,
        "scheduler.slots_changed",
        slots_changed(node, 2, s1=healthy, s2=healthy, s7=("cleanup_blocked", "failed", "x")),
    )
    await publish(nc, "scheduler.slots_changed", slots_changed(node, 1, s1=("disabled", "degraded", "old")))
    await caught_up(http, view)
    _, h = await get(http, f"{view.url}/v1/hosts/{node}")
    assert h["mode"] == "retired"
    assert [(c["from_mode"], c["to_mode"]) for c in h["mode_history"]] == [("drained", "retired"), ("slice", "drained")]
    # A restart: the followers stop, events go on, they start again from their committed positions.
    await view.stop()
    alloc = uuid.uuid4()
    await lifecycle(nc, alloc, "after-restart", node)
    await publish(
        nc,
        "placement.force_released",
        m.PlacementForceReleased(
            allocation_id=alloc, node_ids=[node], slot_ids=[f"{node}-s1"], actor="ops", reason="stuck", forced=True
        ),
    )
    await publish(
        nc,
        "scheduler.slots_changed",
        slots_changed(node, 3, s1=healthy, s2=("disabled", "healthy", "fan"), s7=("cleanup_blocked", "failed", "x")),
    )
    view.tasks.extend(asyncio.create_task(f.run()) for f in view.followers)
    await caught_up(http, view)
    _, h = await get(http, f"{view.url}/v1/hosts/{node}")
    announced = {s["slot_id"]: (s["announced_status"], s["health_state"]) for s in h["slots"]}
    assert announced == {
        f"{node}-s1": ("available", "healthy"),
        f"{node}-s2": ("disabled", "healthy"),
        f"{node}-s7": ("cleanup_blocked", "failed"),
    }
    _, a = await get(http, f"{view.url}/v1/allocations/{alloc}")
    assert [t["seq"] for t in a["timeline"]] == [1, 2, 3, 4]
    assert [p["phase"] for p in a["tasks"][0]["phases"]] == ["preflight", "clone", "boot", "ssh"]
    assert {c["forced_by"] for c in a["claims"]} == {"ops"}

    # The rebuild: an empty schema in another database, the same streams from their first message.
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_server.dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    rebuilt = await _start_view(nc, postgres_server.dsn.rsplit("/", 1)[0] + f"/{name}", f"rb-{uuid.uuid4().hex[:6]}")
    try:
        await caught_up(http, rebuilt, timeout=60)
        await caught_up(http, view)  # the rebuild's own dead letters, if any, reach the live DLQ model too
        await caught_up(http, rebuilt)
        live, again = await _dump(view.pool), await _dump(rebuilt.pool)
        for table in MODEL_TABLES:
            if table == "dead_letters":
                live[table] = [r for r in live[table] if not r[2].startswith("rb-")]
                again[table] = [r for r in again[table] if not r[2].startswith("rb-")]
            assert live[table] == again[table], table
        assert live["allocations"] and live["node_task_phases"] and live["hosts"] and live["audit_records"]
        assert len(live["host_mode_history"]) == 2
    finally:
        await _close(rebuilt)
        admin = await asyncpg.connect(postgres_server.dsn)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
