"""Catalog state changes and the activation gate. Each function works in the caller's unit of work:
its rows through `uow.repos`, its events into `uow.events`.

Replicas: the gate is no poller. It is evaluated inside the transaction of whatever changed its inputs (a
host's cache report, an enrolment, a publish), each of which first locks the image's row; so two replicas
judging one image run one after the other and the second finds it active already and does nothing.
Prewarm asks go out in those same transactions."""

from __future__ import annotations

import uuid
from typing import Any

from gpuaas_common.api_error import ApiError
from gpuaas_common.bus import PermanentError
from gpuaas_common.contract import HostMode, TaskType, derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..domain.catalog import (
    PROTECTED_METADATA,
    ImageCreate,
    ImageUpdate,
    activation_event_id_key,
    activation_ready,
    node_schedulable,
)
from ..domain.tenancy import REFUSED_ENROLMENT, refusal_reason
from .ports import ImagePipelineRepositories, ImagePipelineUnitOfWork, Row

log = get_logger(__name__)
# gpuaas_common's UnitOfWork over adapters/repository.py's repositories, or a FakeUnitOfWork in unit tests.
Uow = ImagePipelineUnitOfWork


class CatalogError(ApiError):
    """A catalog operation's refusal (see gpuaas_common.api_error)."""

    def __init__(self, status: int, code: str, reason: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(status, code, reason, details)
        self.reason = reason


def _meta(row: Row) -> dict[str, Any]:
    """A copy of the image's metadata, free to change before it is written back."""
    return dict(row["metadata"] or {})


def image_dict(row: Row) -> dict[str, Any]:
    return {
        "slug": row["slug"],
        "kind": row["kind"],
        "status": row["status"],
        "driver_strategy": row["driver_strategy"],
        "compatible_sku": row["compatible_sku"],
        "source_uri": row["source_uri"],
        "digest_sha256": row["digest_sha256"],
        "metadata": _meta(row),
        "created_at": row["created_at"].isoformat(),
        "updated_at": row["updated_at"].isoformat(),
    }


async def node_caches(repos: ImagePipelineRepositories, slug: str) -> list[dict[str, Any]]:
    rows = await repos.hosts.caches_of_every_host(slug)
    digest = await repos.images.digest(slug)
    out = []
    for r in rows:
        d = dict(r)
        d["status"] = d["status"] or "absent"
        d["schedulable"] = node_schedulable(digest, (r["status"], r["digest_sha256"]) if r["status"] else None)
        for k in ("verified_at", "updated_at"):
            d[k] = d[k].isoformat() if d[k] else None
        out.append(d)
    return out


async def emit_activated(uow: Uow, row: Row) -> None:
    seq = await uow.repos.images.activate(row["slug"])
    meta = _meta(row)
    await uow.events.add(
        "image.activated",
        m.ImageActivated(
            slug=row["slug"],
            kind=row["kind"],
            sku=row["compatible_sku"],
            digest_sha256=row["digest_sha256"],
            image_path=meta["image_path"],
            source_uri=row["source_uri"],
            driver_strategy=row["driver_strategy"],
            driver_version=meta.get("driver_version"),
        ),
        aggregate_id=f"image:{row['slug']}",
        event_id=derived_event_id(activation_event_id_key(row["slug"], row["digest_sha256"], seq), "activated"),
    )
    log.info("image_activated", slug=row["slug"], digest=row["digest_sha256"], seq=seq)


async def emit_deactivated(uow: Uow, slug: str, reason: str) -> None:
    await uow.events.add(
        "image.deactivated", m.ImageDeactivated(slug=slug, reason=reason), aggregate_id=f"image:{slug}"
    )
    log.info("image_deactivated", slug=slug, reason=reason)


async def evaluate_gate(uow: Uow, slug: str) -> bool:
    """Activate a published slice image once every known slice host verified the catalog digest."""
    row = await uow.repos.images.lock(slug)
    if row is None or row["status"] != "published" or row["kind"] != "slice" or not row["digest_sha256"]:
        return False
    hosts = set(await uow.repos.hosts.node_ids())
    caches = await uow.repos.hosts.cache_states(slug)
    if not activation_ready(row["digest_sha256"], hosts, caches):
        return False
    await emit_activated(uow, row)
    return True


async def set_cache(
    uow: Uow,
    *,
    node_id: str,
    slug: str,
    status: str,
    digest: str | None,
    expected: str | None,
    local_path: str | None,
    task_id: str | None = None,
    done: int = 0,
    total: int = 0,
    reason: str | None = None,
) -> None:
    prev = await uow.repos.hosts.cache(node_id, slug)
    await uow.repos.hosts.set_cache(
        node_id=node_id,
        slug=slug,
        status=status,
        digest=digest,
        expected=expected,
        local_path=local_path,
        task_id=task_id,
        done=done,
        total=total,
        reason=reason,
    )
    if prev is None or (prev["status"], prev["digest_sha256"]) != (status, digest):
        catalog_digest = await uow.repos.images.digest(slug)
        await uow.events.add(
            "image.node_cache_changed",
            m.ImageNodeCacheChanged(
                node_id=node_id,
                slug=slug,
                status=status,  # type: ignore[arg-type]  # one of the contract's, which the model checks
                digest_sha256=digest,
                schedulable=node_schedulable(catalog_digest, (status, digest)),
            ),
            aggregate_id=f"image:{slug}",
        )


async def send_prewarm(uow: Uow, row: Row, node_id: str, cause: str, *, recheck: bool = False) -> bool:
    """Ask one host to prewarm the image unless it already holds this digest verified (or, with `recheck`,
    whatever it holds: a host that just started proves its cache again).

    An image without an artifact (a seeded row: provisioning puts it on the hosts) cannot be pulled; the
    host is asked to check its cache all the same, so the catalog shows where it really is."""
    meta = _meta(row)
    if not row["digest_sha256"] or row["kind"] != "slice":
        return False
    artifact = bool(meta.get("artifact_ref") and meta.get("blob_digest"))
    current = await uow.repos.hosts.cache(node_id, row["slug"])
    verified = bool(current and node_schedulable(row["digest_sha256"], (current["status"], current["digest_sha256"])))
    if verified and not recheck:
        return False
    task_id = str(
        uuid.uuid5(uuid.NAMESPACE_URL, f"gpuaas:prewarm:{row['slug']}:{row['digest_sha256']}:{node_id}:{cause}")
    )
    pull = (
        dict(
            artifact_ref=meta["artifact_ref"],
            blob_digest=meta["blob_digest"],
            blob_size=meta["blob_size"],
            blob_media_type=meta["blob_media_type"],
            virtual_size=meta["virtual_size"],
            registry_tls=meta.get("registry_tls", "verify"),
        )
        if artifact
        else {}
    )
    task = m.ImageCachePrewarm(
        task_id=task_id,
        node_id=node_id,
        slug=row["slug"],
        digest_sha256=row["digest_sha256"],
        image_path=meta["image_path"],
        **pull,
    )
    if artifact and not verified:
        # A check alone changes nothing on the host, and a verified host stays schedulable until it answers.
        await set_cache(
            uow,
            node_id=node_id,
            slug=row["slug"],
            status="pulling",
            digest=None,
            expected=row["digest_sha256"],
            local_path=meta["image_path"],
            task_id=task_id,
            total=meta["blob_size"],
        )
    await uow.events.add(
        TaskType.IMAGE_CACHE_PREWARM,
        task,
        aggregate_id=f"node:{node_id}",
        event_id=derived_event_id(task_id, "prewarm"),
        node_id=node_id,
    )
    return True


async def prewarm_everywhere(uow: Uow, slug: str, cause: str) -> int:
    row = await uow.repos.images.lock(slug)
    assert row is not None
    sent = 0
    for node_id in await uow.repos.hosts.node_ids():
        sent += await send_prewarm(uow, row, node_id, cause)
    return sent


# --- admin operations ---------------------------------------------------------------------------


def _no_free_driver_version(metadata: dict[str, Any]) -> None:
    # The version gates placement (issue 29): only its validated field may set it.
    if "driver_version" in metadata:
        raise CatalogError(422, "protected_metadata", "driver_version is a field of its own, not free metadata")


async def create_image(uow: Uow, req: ImageCreate, cache_dir: str) -> Row:
    image_path = req.image_path or (
        f"{cache_dir.rstrip('/')}/{req.slug}.raw" if req.kind == "slice" else f"custom/{req.slug}"
    )
    _no_free_driver_version(req.metadata)
    meta = {**req.metadata, "image_path": image_path}
    if req.driver_version is not None:
        meta["driver_version"] = req.driver_version
    row = await uow.repos.images.create(req.slug, req.kind, req.driver_strategy, req.compatible_sku, meta)
    if row is None:
        raise CatalogError(409, "exists", f"image {req.slug} already exists")
    return row


async def update_image(uow: Uow, slug: str, req: ImageUpdate) -> Row:
    row = await uow.repos.images.lock(slug)
    if row is None:
        raise CatalogError(404, "not_found", f"no image {slug}")
    meta = _meta(row)
    if req.metadata:
        _no_free_driver_version(req.metadata)
        bad = sorted(set(req.metadata) & set(PROTECTED_METADATA))
        if bad:
            raise CatalogError(422, "protected_metadata", f"{', '.join(bad)} come from builds, not from updates")
        meta.update(req.metadata)
    if req.driver_version is not None:
        meta["driver_version"] = req.driver_version
    row = await uow.repos.images.amend(slug, req.compatible_sku, req.driver_strategy, meta)
    if row["status"] == "active":
        await emit_activated(uow, row)  # consumers learn the new SKU / strategy
        row = await uow.repos.images.lock(slug)
    return row  # type: ignore[return-value]  # locked above, so still there


async def enable_image(uow: Uow, slug: str) -> Row:
    row = await uow.repos.images.lock(slug)
    if row is None:
        raise CatalogError(404, "not_found", f"no image {slug}")
    if row["status"] == "active":
        return row
    if not row["digest_sha256"]:
        raise CatalogError(409, "not_built", f"{slug} has no digest yet: build or republish it first")
    maas = _meta(row).get("maas")
    if row["kind"] == "host" and maas and maas.get("status") != "uploaded":
        # A host image built here is deployable only once MAAS holds it complete.
        raise CatalogError(409, "not_uploaded", f"{slug} is {maas.get('status')} in MAAS, not uploaded")
    if row["kind"] == "host":
        # Host images live in MAAS: nothing to gate on. A seed-style slice image (no artifact) passes the gate
        # as a built one does, its hosts asked to check their caches.
        await emit_activated(uow, row)
        await prewarm_everywhere(uow, slug, cause=f"enable:{uuid.uuid4()}")
    else:
        await uow.repos.images.update(slug, status="published")
        if not await evaluate_gate(uow, slug):
            await prewarm_everywhere(uow, slug, cause=f"enable:{uuid.uuid4()}")
    return await uow.repos.images.lock(slug)  # type: ignore[return-value]


async def disable_image(uow: Uow, slug: str) -> Row:
    row = await uow.repos.images.lock(slug)
    if row is None:
        raise CatalogError(404, "not_found", f"no image {slug}")
    if row["status"] != "disabled":
        await uow.repos.images.update(slug, status="disabled")
        await emit_deactivated(uow, slug, "disabled by an operator")
    return await uow.repos.images.lock(slug)  # type: ignore[return-value]


async def delete_image(uow: Uow, slug: str) -> None:
    row = await uow.repos.images.lock(slug)
    if row is None:
        raise CatalogError(404, "not_found", f"no image {slug}")
    await uow.repos.images.delete(slug)
    await emit_deactivated(uow, slug, "deleted from the catalog")


# --- bus handlers ---------------------------------------------------------------------------------


async def on_enrolled(uow: Uow, ev: m.NodeEnrolled, event_id: str) -> int:
    if ev.kind != "slice_host":
        return 0
    await _refuse_a_tenants_host(uow, ev.node_id)
    await uow.repos.hosts.enrolled(ev.node_id, ev.hostname)
    sent = 0
    for slug in await uow.repos.images.prewarmable_slugs():
        locked = await uow.repos.images.lock(slug)
        # Every start re-proves the cache: a file lost or changed while the agent was down shows at once.
        sent += await send_prewarm(uow, locked, ev.node_id, cause=f"enrolled:{event_id}", recheck=True)  # type: ignore[arg-type]
    return sent


async def _refuse_a_tenants_host(uow: Uow, node_id: str) -> None:
    """A baremetal tenant holds root on its host and the host's allocation-bound creds, so it can announce the
    host as a slice host: refused (dead-lettered with the reason; nothing written, no prewarm) while the node
    is under a baremetal tenancy (domain/tenancy.py). The node's lock orders this against the placement that
    starts a tenancy (service_layer/tenancy.py)."""
    await uow.repos.tenancies.lock_node(node_id)
    held = await uow.repos.tenancies.open_on(node_id)
    if not held:
        return
    allocations = [str(r["allocation_id"]) for r in held]
    log.warning(
        "slice_host_enrolment_refused", node_id=node_id, reason_code=REFUSED_ENROLMENT, allocation_ids=allocations
    )
    raise PermanentError(REFUSED_ENROLMENT, refusal_reason(node_id, allocations))


async def on_cache_reported(uow: Uow, ev: m.NodeImageCacheReported) -> None:
    row = await uow.repos.images.lock(ev.slug)
    if row is None or row["digest_sha256"] != ev.expected_digest:
        log.info("stale_cache_report_ignored", slug=ev.slug, node_id=ev.node_id, expected=ev.expected_digest)
        return
    status = ev.status
    if status == "pulling":
        current = await uow.repos.hosts.cache(ev.node_id, ev.slug)
        if (
            current
            and current["task_id"] == ev.task_id
            and current["status"] in ("verified", "mismatch", "failed", "absent")
        ):
            return  # progress overtaken by the task's own verdict
    if status == "verified" and ev.digest_sha256 != row["digest_sha256"]:
        status = "mismatch"  # never trust a verdict that disagrees with its own digest
    await set_cache(
        uow,
        node_id=ev.node_id,
        slug=ev.slug,
        status=status,
        digest=ev.digest_sha256,
        expected=ev.expected_digest,
        local_path=ev.local_path,
        task_id=ev.task_id,
        done=ev.bytes_done,
        total=ev.bytes_total,
        reason=ev.reason,
    )
    if status == "verified":
        await evaluate_gate(uow, ev.slug)


# --- hosts leaving the gate ------------------------------------------------------------------------

# Modes in which a host is no slice host the activation gate waits for: retired (out of the fleet: a dead host
# would block every activation for good) or serving baremetal tenants. It joins again when its agent enrols as a
# slice host (prewarmed then, and placed on an image only once its cache verified it).
GATE_LEAVING_MODES = (HostMode.RETIRED, HostMode.BAREMETAL)


async def on_host_mode_changed(uow: Uow, ev: m.HostModeChanged) -> bool:
    """The scheduler moved a host: one retired or made baremetal leaves the slice hosts. Whether it left."""
    if ev.to_mode not in GATE_LEAVING_MODES:
        return False
    return await leave_slice_hosts(uow, ev.node_id, f"the host is {ev.to_mode}: {ev.reason}"[:500], why=ev.to_mode)


async def leave_slice_hosts(uow: Uow, node_id: str, absent_reason: str, *, why: str) -> bool:
    """The node is no slice host any more: its caches count for nothing, and every gated image is judged again
    without it (the gate may be satisfied already). False when it was none."""
    was_slice_host = await uow.repos.hosts.forget(node_id)
    caches = [c for c in await uow.repos.hosts.caches_of(node_id) if c["status"] != "absent"]
    gated = await uow.repos.images.prewarmable_slugs() if was_slice_host else []
    # Every image this touches is locked first, in slug order, as enrolments and cache reports lock them.
    for slug in sorted({c["slug"] for c in caches} | set(gated)):
        await uow.repos.images.lock(slug)
    for cache in caches:
        await set_cache(
            uow,
            node_id=node_id,
            slug=cache["slug"],
            status="absent",
            digest=None,
            expected=cache["expected_digest"],
            local_path=None,
            task_id=cache["task_id"],
            reason=absent_reason,
        )
    if not was_slice_host:
        return False
    log.info("slice_host_left", node_id=node_id, why=why)
    for slug in gated:
        await evaluate_gate(uow, slug)
    return True
