"""A baremetal host cannot enrol as a slice host (issue 24, point 7), across a real nats-server and Postgres.

A real `gpuaas-image-pipeline` process follows the allocator's MAAS deploys (`maas.deploy_requested`: a baremetal
allocation's deploy went out) and the gateway's MAAS release results. While a baremetal allocation holds a node,
a `node.enrolled` of kind `slice_host` from that node (a tenant has root on the host and its allocation-bound
creds, so it can publish one) is dead-lettered with the reason `baremetal_tenancy` and a structured log line:
the node is not written into slice_hosts and gets no prewarm task. Once the tenancy is over (the machine
released through MAAS, at the allocation's release or after a failure that followed the deploy) the same node
enrols as a slice host like any other. A slice host that a baremetal allocation takes leaves the slice hosts at
once. A host walk's deploy (the scheduler's) opens no tenancy. The allocator's messages come as it publishes them
(placed, provisioning and the deploy together; released after the gateway's answer). Every message on `gpuaas.>`
is checked against the contract."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest

from gpuaas_common.bus import Bus
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.migrations import COMMON_MIGRATIONS, apply_migrations, service_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_dev.seed_images import build_seed
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.servers import NatsServer
from gpuaas_dev.testing.waiting import eventually, service_ready
from gpuaas_image_pipeline.adapters.repository import image_pipeline_repositories
from gpuaas_image_pipeline.service_layer import catalog, tenancy

BIN = Path(sys.executable).parent
SCHEMA = "image_pipeline"
DLQ_SUBJECT = "gpuaas.dlq.image-pipeline-enrolments"


@pytest.fixture
def nats_srv(tmp_path: Path):
    # A server of its own: the pipeline's durables start from an empty stream.
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
async def pipeline(nats_srv: NatsServer, fresh_db: str, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """A real `gpuaas-image-pipeline` process with the dev stack's seed images (an active slice image, so an
    accepted slice host is asked to check its cache: a prewarm task)."""
    seed_file = build_seed(tmp_path / "images")
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, SCHEMA, "gpuaas_image_pipeline.migrations")
    await conn.close()
    ready = tmp_path / "pipeline.ready"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")},
        "GPUAAS_NATS_URL": nats_srv.url,
        "GPUAAS_NATS_INSECURE_DEV": "true",
        "GPUAAS_DATABASE_URL": fresh_db,
        "GPUAAS_READY_FILE": str(ready),
        "GPUAAS_HEALTH_PORT": "0",
        "GPUAAS_IMAGE_SEED_FILE": str(seed_file),
        "GPUAAS_IMAGE_BUILD_DIR": str(tmp_path / "builds"),
        "GPUAAS_HOST_IMAGE_DIR": str(tmp_path / "host-images"),
    }
    log_path = tmp_path / "pipeline.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(str(BIN / "gpuaas-image-pipeline"), env=env, stdout=log, stderr=log)
        try:
            await service_ready(ready, proc, log_path)
            db = await asyncpg.connect(fresh_db, server_settings={"search_path": SCHEMA})
            try:
                yield {"db": db, "log": log_path}
            finally:
                await db.close()
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)


class World:
    """The other side of the pipeline: the allocator's lifecycle events, the gateway's MAAS results and the
    host's enrolments, each published as its producer would (contract-valid, through JetStream)."""

    def __init__(self, nc: nats.NATS, db: asyncpg.Connection, spy: BusSpy, log: Path) -> None:
        js = nc.jetstream()
        self.allocator = Bus(nc, js, service="allocator", schema=None, pool=None)
        self.scheduler = Bus(nc, js, service="scheduler", schema=None, pool=None)
        self.gateway = Bus(nc, js, service="maas-gateway", schema=None, pool=None)
        self.host = Bus(nc, js, service="node-agent", schema=None, pool=None)
        self.db = db
        self.spy = spy
        self.log = log
        self.seq: dict[uuid.UUID, int] = {}

    async def lifecycle(self, type_: str, payload_cls: type[m.AllocationEvent], alloc: uuid.UUID, **kw: Any) -> None:
        seq = self.seq[alloc] = self.seq.get(alloc, 1) + 1
        payload = payload_cls(
            allocation_id=alloc, tenant_id="tenant-a", shape="baremetal", state=type_.split(".")[1], seq=seq, **kw
        )
        await self.allocator.publish(type_, payload, correlation_id=str(alloc))

    async def placed(self, alloc: uuid.UUID, node: str) -> None:
        await self.lifecycle(
            "allocation.placed",
            m.AllocationPlaced,
            alloc,
            node_id=node,
            claim_mode="node_exclusive",
            maas_system_id="m1",
        )

    async def provisioning(self, alloc: uuid.UUID, node: str) -> None:
        """The deploy going out, as the allocator publishes it: the command to the gateway, and the lifecycle."""
        deploy = m.MaasDeployRequested(
            operation_id=f"deploy-{alloc}", allocation_id=alloc, site="s", system_id="m1", node_id=node, profile="bm"
        )
        await self.allocator.publish("maas.deploy_requested", deploy, correlation_id=str(alloc))
        await self.lifecycle(
            "allocation.provisioning", m.AllocationProvisioning, alloc, node_id=node, operation_id=f"deploy-{alloc}"
        )

    async def machine_released(self, alloc: uuid.UUID, node: str) -> None:
        """The gateway's answer to the machine's release: MAAS took it back (the host's user revoked first)."""
        result = m.MaasReleaseResult(
            operation_id=f"release-{alloc}",
            allocation_id=alloc,
            system_id="m1",
            node_id=node,
            resolution="direct",
            maas_status_name="Ready",
            attempts=1,
            status="released",
        )
        await self.gateway.publish("maas.release_result", result, correlation_id=str(alloc))

    async def enrol(self, node: str) -> str:
        enrolled = m.NodeEnrolled(node_id=node, kind="slice_host", hostname=f"{node}.test", agent_version="t")
        envelope = await self.host.publish("node.enrolled", enrolled, correlation_id=node, node_id=node)
        return envelope.event_id

    async def tenancy(self, alloc: uuid.UUID) -> asyncpg.Record | None:
        return await self.db.fetchrow("SELECT * FROM baremetal_tenancies WHERE allocation_id = $1", alloc)

    async def tenancy_is(self, alloc: uuid.UUID, state: str) -> None:
        async def reached() -> bool:
            row = await self.tenancy(alloc)
            return row is not None and row["state"] == state

        await eventually(reached, timeout=30, what=f"tenancy {alloc} {state}")

    async def slice_hosts(self) -> set[str]:
        return {r["node_id"] for r in await self.db.fetch("SELECT node_id FROM slice_hosts")}

    def prewarms(self, node: str) -> list[dict[str, Any]]:
        return self.spy.of_type("image.cache_prewarm", node_id=node)

    async def refused(self, node: str, enrolment_id: str) -> dict[str, Any]:
        """The enrolment's dead letter, with everything its refusal must (not) have left behind."""
        letter = await self.spy.wait_for(
            lambda: [d for s, d in self.spy.messages if s == DLQ_SUBJECT and _letter_of(d, enrolment_id)],
            what=f"the dead letter of {node}'s enrolment",
        )
        payload = letter[0]["payload"]
        assert payload["reason_code"] == "baremetal_tenancy", payload
        assert node in payload["reason"] and "slice host" in payload["reason"]
        assert node not in await self.slice_hosts()
        # Nothing of the refused enrolment was committed: no prewarm in the outbox (so none on the bus, ever).
        outbox = [json.loads(bytes(r["body"])) for r in await self.db.fetch("SELECT body FROM outbox")]
        assert not [e for e in outbox if e["causation_id"] == enrolment_id], outbox
        assert not [p for p in self.prewarms(node) if p["causation_id"] == enrolment_id]
        lines = [json.loads(x) for x in self.log.read_text().splitlines() if "slice_host_enrolment_refused" in x]
        assert any(x["node_id"] == node and x["reason_code"] == "baremetal_tenancy" for x in lines), lines
        return payload

    async def accepted(self, node: str, enrolment_id: str) -> None:
        await self.spy.wait_for(
            lambda: [p for p in self.prewarms(node) if p["causation_id"] == enrolment_id],
            what=f"a prewarm task for {node}, caused by its enrolment",
        )
        assert node in await self.slice_hosts()


def _letter_of(data: dict[str, Any], enrolment_id: str) -> bool:
    """A dead letter of the enrolment: its body (kept as text) is the enrolment's envelope."""
    if data.get("type") != "dead_letter":
        return False
    body = data["payload"].get("body_text") or ""
    return data["payload"].get("consumer") == "image-pipeline-enrolments" and enrolment_id in body


@pytest.fixture
async def world(nats_srv: NatsServer, pipeline: dict[str, Any]) -> AsyncIterator[World]:
    spy = await BusSpy(nats_srv.url).start()
    nc = await nats.connect(nats_srv.url)
    try:
        yield World(nc, pipeline["db"], spy, pipeline["log"])
    finally:
        await nc.drain()
        await spy.stop()
    assert spy.violations == [], spy.violations[:3]


async def test_a_tenants_host_is_refused_as_a_slice_host_until_its_allocation_is_released(world: World) -> None:
    node, alloc = f"bm-{uuid.uuid4().hex[:6]}", uuid.uuid4()
    await world.placed(alloc, node)
    await world.provisioning(alloc, node)
    await world.tenancy_is(alloc, "open")

    # The tenant, root on the host with the allocation's creds, announces it as a slice host.
    first = await world.enrol(node)
    await world.refused(node, first)

    # Released through MAAS (the gateway revoked the allocation's host user, MAAS erased the disk); the allocator
    # reports `released` on the gateway's answer.
    await world.lifecycle("allocation.releasing", m.AllocationReleasing, alloc)
    await world.machine_released(alloc, node)
    cleanup = m.CleanupReport(required=True, verified=True, reason="MAAS Ready")
    await world.lifecycle("allocation.released", m.AllocationReleased, alloc, node_id=node, cleanup=cleanup)
    await world.tenancy_is(alloc, "machine_released")
    assert (await world.tenancy(alloc))["ended_at"] is not None

    # The same host, back in slice mode, enrols like any slice host.
    again = await world.enrol(node)
    await world.accepted(node, again)


async def test_a_failed_allocations_tenancy_ends_when_its_machine_is_released(world: World) -> None:
    node, alloc = f"bm-{uuid.uuid4().hex[:6]}", uuid.uuid4()
    # A slice host first: known to the gate, asked to check its cache.
    await world.accepted(node, await world.enrol(node))
    # A baremetal allocation takes the node whole (placed, and its deploy sent with it): it leaves the slice
    # hosts at once.
    await world.placed(alloc, node)
    await world.provisioning(alloc, node)
    await world.tenancy_is(alloc, "open")
    assert node not in await world.slice_hosts()
    # Then the allocation failed: the machine may run the tenant's image with its keys.
    await world.lifecycle(
        "allocation.failed",
        m.AllocationFailed,
        alloc,
        node_id=node,
        reason_code="deploy_failed",
        reason="MAAS: Failed deployment",
        cleanup_required=True,
    )
    await world.refused(node, await world.enrol(node))
    assert (await world.tenancy(alloc))["open"] is True

    # The allocator releases the failed allocation's machine; only the gateway's answer ends the tenancy.
    await world.machine_released(alloc, node)
    await world.tenancy_is(alloc, "machine_released")
    await world.accepted(node, await world.enrol(node))


async def test_a_baremetal_allocation_that_failed_before_its_deploy_never_held_the_node(world: World) -> None:
    node, alloc = f"bm-{uuid.uuid4().hex[:6]}", uuid.uuid4()
    # Placed while a release was under way: released at once, no deploy ever sent (the allocator's
    # "released before provisioning").
    await world.placed(alloc, node)
    cleanup = m.CleanupReport(required=False, verified=True, reason="released before provisioning")
    await world.lifecycle("allocation.released", m.AllocationReleased, alloc, node_id=node, cleanup=cleanup)
    await world.accepted(node, await world.enrol(node))
    assert await world.tenancy(alloc) is None


async def test_a_host_walks_deploy_hands_the_node_to_no_tenant(world: World) -> None:
    node, walk = f"bm-{uuid.uuid4().hex[:6]}", uuid.uuid4()
    # The scheduler converts a host back to slice mode: a deploy with the slice-host profile, then the host enrols.
    deploy = m.MaasDeployRequested(
        operation_id=f"walk-{walk}", allocation_id=walk, site="s", system_id="m1", node_id=node, profile="slice-host"
    )
    await world.scheduler.publish("maas.deploy_requested", deploy, correlation_id=f"walk-{walk}")
    await world.accepted(node, await world.enrol(node))
    assert await world.tenancy(walk) is None


# --- the handlers against a real Postgres, without the bus --------------------------------------------------

BUILT = "b" * 64


def _uow(pool: asyncpg.Pool) -> UnitOfWork:
    return UnitOfWork(pool, SCHEMA, "image-pipeline", image_pipeline_repositories)


async def _deploy(pool: asyncpg.Pool, alloc: uuid.UUID, node: str, at: datetime, producer: str = "allocator") -> None:
    cmd = m.MaasDeployRequested(
        operation_id=f"deploy-{alloc}", allocation_id=alloc, site="s", system_id="m1", node_id=node, profile="p"
    )
    envelope = Envelope.wrap(
        "maas.deploy_requested", cmd.model_dump(mode="json"), producer=producer, correlation_id=str(alloc)
    ).model_copy(update={"occurred_at": at})
    async with _uow(pool) as uow:
        await tenancy.on_deploy_requested(uow, cmd, envelope)
        await uow.commit()


async def test_a_slice_host_taken_whole_leaves_the_gate_and_a_later_deploy_supersedes_a_stuck_tenancy(
    fresh_db: str,
) -> None:
    conn = await asyncpg.connect(fresh_db, server_settings={"search_path": SCHEMA})
    await apply_migrations(conn, SCHEMA, "gpuaas_image_pipeline.migrations")
    pool = await asyncpg.create_pool(fresh_db, min_size=1, max_size=2, server_settings={"search_path": SCHEMA})
    meta = {
        "image_path": "/var/lib/gpuaas/slice-images/img.raw",
        "artifact_ref": "oci://r/ns/img:t@sha256:" + "1" * 64,
        "blob_digest": "sha256:" + "2" * 64,
        "blob_size": 10,
        "blob_media_type": "x",
        "virtual_size": 100,
        "registry_tls": "plain-http",
    }
    try:
        await conn.execute(
            "INSERT INTO os_images (slug, kind, status, compatible_sku, digest_sha256, metadata) "
            "VALUES ('img', 'slice', 'published', 'h200-sxm-slice', $1, $2)",
            BUILT,
            json.dumps(meta),
        )
        async with _uow(pool) as uow:
            for node in ("n1", "bm"):
                enrolled = m.NodeEnrolled(node_id=node, kind="slice_host", hostname=node, agent_version="t")
                assert await catalog.on_enrolled(uow, enrolled, f"ev-{node}") == 1
            report = m.NodeImageCacheReported(
                task_id="t",
                node_id="n1",
                slug="img",
                status="verified",
                expected_digest=BUILT,
                digest_sha256=BUILT,
                local_path="/x",
            )
            await catalog.on_cache_reported(uow, report)
            await uow.commit()
        assert await conn.fetchval("SELECT status FROM os_images") == "published"  # bm is still pulling

        # A baremetal allocation takes bm whole (its deploy went out): it leaves the slice hosts, its cache counts
        # as gone, and the image no longer waits for it.
        t0 = datetime.now(timezone.utc)
        first, second = uuid.uuid4(), uuid.uuid4()
        await _deploy(pool, first, "bm", t0)
        assert {r["node_id"] for r in await conn.fetch("SELECT node_id FROM slice_hosts")} == {"n1"}
        cache = await conn.fetchrow("SELECT status, reason FROM node_image_cache WHERE node_id = 'bm'")
        assert cache["status"] == "absent" and "baremetal tenant" in cache["reason"]
        assert await conn.fetchval("SELECT status FROM os_images") == "active"
        events = [json.loads(bytes(r["body"])) for r in await conn.fetch("SELECT body FROM outbox ORDER BY id")]
        assert [
            (e["payload"]["node_id"], e["payload"]["schedulable"])
            for e in events
            if e["type"] == "image.node_cache_changed"
        ][-1] == ("bm", False)

        # It failed, and the machine's release failed too: the tenancy stays open...
        release_failed = m.MaasReleaseResult(
            operation_id=f"release-{first}",
            allocation_id=first,
            system_id="m1",
            node_id="bm",
            resolution="direct",
            maas_status_name="Deployed",
            reason_code="maas_refused",
            attempts=1,
            status="failed",
        )
        async with _uow(pool) as uow:
            await tenancy.on_machine_released(uow, release_failed)
            await uow.commit()
        assert [r["allocation_id"] for r in await conn.fetch("SELECT * FROM baremetal_tenancies WHERE open")] == [first]
        # ... until the scheduler hands the node to the next baremetal allocation, whose deploy supersedes it.
        await _deploy(pool, second, "bm", t0 + timedelta(seconds=5))
        rows = {r["allocation_id"]: r for r in await conn.fetch("SELECT * FROM baremetal_tenancies")}
        assert (rows[first]["open"], rows[first]["state"], rows[first]["superseded_by"]) == (
            False,
            "superseded",
            second,
        )
        assert rows[first]["ended_at"] is not None
        assert (rows[second]["open"], rows[second]["state"]) == (True, "open")

        # A host walk's deploy (the scheduler's) hands the node to no tenant and leaves no row.
        await _deploy(pool, uuid.uuid4(), "n1", t0, producer="scheduler")
        assert await conn.fetchval("SELECT count(*) FROM baremetal_tenancies") == 2
    finally:
        await pool.close()
        await conn.close()


async def test_the_tenancies_of_the_placement_rules_are_judged_again_by_the_deploy_rules(fresh_db: str) -> None:
    """Migration 008: rows the pipeline kept under the old rules (placed opened a tenancy, released or failed before
    the deploy ended it) keep their judgement under the new ones, except one placed whose deploy was not seen."""
    conn = await asyncpg.connect(fresh_db)
    try:
        await conn.execute(f"CREATE SCHEMA {SCHEMA}")
        await conn.execute(f"CREATE TABLE {SCHEMA}.schema_migrations (version text PRIMARY KEY)")
        before = [
            (version, sql)
            for version, sql in [*COMMON_MIGRATIONS, *service_migrations("gpuaas_image_pipeline.migrations")]
            if version < "008"
        ]
        async with conn.transaction():
            await conn.execute(f"SET LOCAL search_path TO {SCHEMA}")
            for version, sql in before:
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
        ids = {name: uuid.uuid4() for name in ("released", "failed_early", "failed_late", "superseded", "placed")}
        # (started, deploy_sent, released, failed, superseded_by, open, state) as the old rules left them.
        old = {
            "released": (True, True, True, False, None, False, "released"),
            "failed_early": (True, False, False, True, None, False, "failed_before_deploy"),
            "failed_late": (True, True, False, True, None, True, "open"),
            "superseded": (True, True, False, True, ids["failed_late"], False, "superseded"),
            "placed": (True, False, False, False, None, True, "open"),
        }
        for name, (started, sent, released, failed, by, open_, state) in old.items():
            await conn.execute(
                f"INSERT INTO {SCHEMA}.baremetal_tenancies (allocation_id, node_id, placed_at, started, deploy_sent, "
                "released, failed, superseded_by, open, state) VALUES ($1, 'bm', now(), $2, $3, $4, $5, $6, $7, $8)",
                ids[name],
                started,
                sent,
                released,
                failed,
                by,
                open_,
                state,
            )
        assert await apply_migrations(conn, SCHEMA, "gpuaas_image_pipeline.migrations") == ["008_tenancy_from_deploy"]
        rows = {r["allocation_id"]: r for r in await conn.fetch(f"SELECT * FROM {SCHEMA}.baremetal_tenancies")}
        judged = {name: (rows[i]["state"], rows[i]["open"]) for name, i in ids.items()}
        assert judged == {
            "released": ("machine_released", False),
            "failed_early": ("not_deployed", False),
            "failed_late": ("open", True),
            "superseded": ("superseded", False),
            "placed": ("not_deployed", False),
        }
        assert rows[ids["placed"]]["ended_at"] is not None and rows[ids["failed_late"]]["ended_at"] is None
        assert rows[ids["failed_late"]]["deployed_at"] is not None
    finally:
        await conn.close()
