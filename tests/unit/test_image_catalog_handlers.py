"""The image catalog's bus handlers with an in-memory unit of work: the activation gate without servers."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from gpuaas_common.bus import HandlerContext, PermanentError, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.unit_of_work import FakeUnitOfWork
from gpuaas_image_pipeline.domain.catalog import ImageCreate, ImageUpdate
from gpuaas_image_pipeline.service_layer import catalog

SLUG = "ubuntu-slice"
DIGEST = "b" * 64
OTHER = "c" * 64


def _image(status: str = "published") -> dict[str, Any]:
    now = datetime.now(timezone.utc)
    return {
        "slug": SLUG,
        "kind": "slice",
        "status": status,
        "driver_strategy": "preinstalled",
        "compatible_sku": "h200-sxm-slice",
        "source_uri": "oci://r/ns/ubuntu-slice:t@sha256:" + "1" * 64,
        "digest_sha256": DIGEST,
        "activation_seq": 0,
        "created_at": now,
        "updated_at": now,
        "metadata": {
            "image_path": f"/var/lib/gpuaas/slice-images/{SLUG}.raw",
            "artifact_ref": "oci://r/ns/ubuntu-slice:t",
            "blob_digest": "sha256:" + "2" * 64,
            "blob_size": 10,
            "blob_media_type": "x",
            "virtual_size": 100,
            "registry_tls": "plain-http",
        },
    }


class FakeImages:
    """Same surface as adapters.repository.ImageRepository (what the catalog handlers use), in dicts."""

    def __init__(self, *rows: dict[str, Any]) -> None:
        self.rows = {r["slug"]: r for r in rows}

    async def lock(self, slug: str) -> dict[str, Any] | None:
        row = self.rows.get(slug)
        return copy.deepcopy(row) if row else None

    async def digest(self, slug: str) -> str | None:
        row = self.rows.get(slug)
        return row["digest_sha256"] if row else None

    async def prewarmable_slugs(self) -> list[str]:
        return sorted(
            s for s, r in self.rows.items() if r["kind"] == "slice" and r["status"] in ("published", "active")
        )

    async def activate(self, slug: str) -> int:
        row = self.rows[slug]
        row.update(status="active", activation_seq=row["activation_seq"] + 1)
        return row["activation_seq"]

    async def update(self, slug: str, **fields: Any) -> None:
        self.rows[slug].update(copy.deepcopy(fields))


class FakeSliceHosts:
    """Same surface as adapters.repository.SliceHostRepository, in dicts."""

    def __init__(self) -> None:
        self.hosts: dict[str, str] = {}
        self.caches: dict[tuple[str, str], dict[str, Any]] = {}

    async def enrolled(self, node_id: str, hostname: str) -> None:
        self.hosts[node_id] = hostname

    async def node_ids(self) -> list[str]:
        return sorted(self.hosts)

    async def cache(self, node_id: str, slug: str) -> dict[str, Any] | None:
        row = self.caches.get((node_id, slug))
        return copy.deepcopy(row) if row else None

    async def cache_states(self, slug: str) -> dict[str, tuple[str, str | None]]:
        return {n: (c["status"], c["digest_sha256"]) for (n, s), c in self.caches.items() if s == slug}

    async def set_cache(
        self, *, node_id: str, slug: str, status: str, digest: str | None, task_id: str | None, **_: Any
    ) -> None:
        prior = self.caches.get((node_id, slug), {})
        self.caches[(node_id, slug)] = {
            "status": status,
            "digest_sha256": digest,
            "task_id": task_id or prior.get("task_id"),
        }


class FakeTenancies:
    """The part of adapters.repository.TenancyRepository an enrolment uses: the node's open tenancies."""

    def __init__(self) -> None:
        self.open: dict[str, list[str]] = {}  # node -> allocation ids holding it
        self.locked: list[str] = []

    async def lock_node(self, node_id: str) -> None:
        self.locked.append(node_id)

    async def open_on(self, node_id: str) -> list[dict[str, Any]]:
        return [{"allocation_id": a, "node_id": node_id} for a in self.open.get(node_id, [])]


@dataclass
class FakeRepositories:
    images: FakeImages
    hosts: FakeSliceHosts = field(default_factory=FakeSliceHosts)
    tenancies: FakeTenancies = field(default_factory=FakeTenancies)


async def _on_enrolled(ctx: HandlerContext) -> None:
    await catalog.on_enrolled(ctx.uow, ctx.payload, ctx.envelope.event_id)


async def _on_cache_reported(ctx: HandlerContext) -> None:
    await catalog.on_cache_reported(ctx.uow, ctx.payload)


class World:
    def __init__(self, image: dict[str, Any]) -> None:
        self.repos = FakeRepositories(FakeImages(image))
        self.inbox: set[tuple[str, str]] = set()
        self.events: list[Envelope] = []

    async def send(self, handler, type_: str, payload: m.Payload, envelope: Envelope | None = None) -> Envelope:
        env = envelope or Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="c")
        uow = FakeUnitOfWork(self.repos, "image-pipeline", seen=self.inbox)
        await deliver(handler, HandlerContext(env, payload, "subject", "test", 1), uow)
        self.events.extend(uow.published)
        return env

    async def enrol(self, node: str) -> None:
        await self.send(
            _on_enrolled,
            "node.enrolled",
            m.NodeEnrolled(node_id=node, kind="slice_host", hostname=node, agent_version="t"),
        )

    async def report(self, node: str, status: str, digest: str | None, expected: str = DIGEST) -> Envelope:
        return await self.send(
            _on_cache_reported,
            "node.image_cache_reported",
            m.NodeImageCacheReported(
                task_id=f"t-{node}",
                node_id=node,
                slug=SLUG,
                status=status,
                expected_digest=expected,
                digest_sha256=digest,
                local_path="/x",
            ),
        )

    @property
    def status(self) -> str:
        return self.repos.images.rows[SLUG]["status"]

    def sent(self, type_: str) -> list[dict[str, Any]]:
        return [e.payload for e in self.events if e.type == type_]


async def test_activates_only_once_every_known_host_verified_the_catalog_digest() -> None:
    world = World(_image())
    await world.enrol("n1")
    await world.enrol("n2")
    assert sorted(p["node_id"] for p in world.sent("image.cache_prewarm")) == ["n1", "n2"]

    await world.report("n1", "verified", DIGEST)
    assert world.status == "published"  # n2 has not verified yet
    # A "verified" verdict for other bytes is a mismatch, and does not count towards the gate.
    await world.report("n2", "verified", OTHER)
    assert world.repos.hosts.caches[("n2", SLUG)]["status"] == "mismatch"
    assert world.status == "published" and world.sent("image.activated") == []

    last = await world.report("n2", "verified", DIGEST)
    assert world.status == "active"
    [activated] = world.sent("image.activated")
    assert (activated["slug"], activated["digest_sha256"]) == (SLUG, DIGEST)
    changes = [(p["node_id"], p["status"], p["schedulable"]) for p in world.sent("image.node_cache_changed")]
    assert changes[-3:] == [("n1", "verified", True), ("n2", "mismatch", False), ("n2", "verified", True)]

    # The same report delivered again is a no-op: no second activation.
    before = len(world.events)
    await world.send(_on_cache_reported, last.type, m.NodeImageCacheReported.model_validate(last.payload), last)
    assert len(world.events) == before and len(world.sent("image.activated")) == 1


async def test_a_host_enrolled_later_must_verify_too() -> None:
    world = World(_image())
    await world.enrol("n1")
    await world.report("n1", "pulling", None)
    await world.enrol("n2")
    await world.report("n2", "verified", DIGEST)
    assert world.status == "published"  # n1 is still pulling
    await world.report("n1", "verified", DIGEST)
    assert world.status == "active"


async def test_a_report_about_another_digest_changes_nothing() -> None:
    world = World(_image())
    await world.enrol("n1")
    caches = copy.deepcopy(world.repos.hosts.caches)
    await world.report("n1", "verified", OTHER, expected=OTHER)
    assert world.repos.hosts.caches == caches
    assert world.status == "published" and world.sent("image.activated") == []


async def test_the_activation_announces_the_guest_driver_version_the_catalog_records() -> None:
    """Issue 29, point 4: placement matches it against each partitioned host's Fabric Manager."""
    image = _image()
    image["metadata"]["driver_version"] = "580.159.04"
    world = World(image)
    await world.enrol("n1")
    await world.report("n1", "verified", DIGEST)
    [activated] = world.sent("image.activated")
    assert activated["driver_version"] == "580.159.04"
    world = World(_image())  # an image the catalog knows no driver of: no gate
    await world.enrol("n1")
    await world.report("n1", "verified", DIGEST)
    assert world.sent("image.activated")[0]["driver_version"] is None


class _Created:
    def __init__(self) -> None:
        self.meta: dict[str, Any] | None = None

    async def create(self, slug: str, kind: str, strategy: str, sku: str, meta: dict[str, Any]) -> dict[str, Any]:
        self.meta = meta
        return {"slug": slug}


async def test_the_driver_version_is_set_only_through_its_validated_field() -> None:
    created = _Created()
    uow = FakeUnitOfWork(FakeRepositories(created), "image-pipeline")  # type: ignore[arg-type]
    await catalog.create_image(uow, ImageCreate(slug="s", driver_version="580.159.04"), "/cache")
    assert created.meta == {"image_path": "/cache/s.raw", "driver_version": "580.159.04"}
    for bad in ("580", "r580", "580.159.04-open"):
        with pytest.raises(ValidationError):
            ImageCreate(slug="s", driver_version=bad)
        with pytest.raises(ValidationError):
            ImageUpdate(driver_version=bad)
    with pytest.raises(catalog.CatalogError) as refused:
        await catalog.create_image(uow, ImageCreate(slug="t", metadata={"driver_version": "anything"}), "/cache")
    assert (refused.value.status, refused.value.code) == (422, "protected_metadata")


async def test_a_slice_host_enrolment_from_a_tenants_node_is_refused_with_its_reason() -> None:
    """A baremetal tenant's host announcing itself as a slice host: dead-lettered (PermanentError with the
    contract's reason code), not a slice host, no prewarm, nothing committed; another node is unaffected."""
    world = World(_image())
    world.repos.tenancies.open["bm1"] = ["5b0c6f3e-0000-4000-8000-000000000001"]
    with pytest.raises(PermanentError) as refused:
        await world.enrol("bm1")
    assert refused.value.reason_code == "baremetal_tenancy"
    assert "bm1" in refused.value.reason and "5b0c6f3e-0000-4000-8000-000000000001" in refused.value.reason
    assert world.repos.hosts.hosts == {} and world.events == [] and world.inbox == set()
    assert world.repos.tenancies.locked == ["bm1"]  # judged under the node's lock

    await world.enrol("n1")
    assert [p["node_id"] for p in world.sent("image.cache_prewarm")] == ["n1"]
    # A baremetal-kind enrolment is the allocator's business, and no slice-host row either way.
    await world.send(
        _on_enrolled,
        "node.enrolled",
        m.NodeEnrolled(node_id="bm1", kind="baremetal", hostname="bm1", agent_version="t"),
    )
    assert sorted(world.repos.hosts.hosts) == ["n1"]
