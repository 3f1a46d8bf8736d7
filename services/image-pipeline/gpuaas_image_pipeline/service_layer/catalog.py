"""Catalog state changes and the activation gate. Each function runs inside the caller's transaction
and writes its events to the outbox of that transaction."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg

from gpuaas_common.api_error import ApiError
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import OutboxWriter

from ..domain.catalog import (
    PROTECTED_METADATA,
    ImageCreate,
    ImageUpdate,
    activation_event_id_key,
    activation_ready,
    node_schedulable,
)

log = get_logger(__name__)


class CatalogError(ApiError):
    """A catalog operation's refusal (see gpuaas_common.api_error)."""

    def __init__(self, status: int, code: str, reason: str, details: dict | None = None) -> None:
        super().__init__(status, code, reason, details)
        self.reason = reason


def _meta(row: asyncpg.Record) -> dict[str, Any]:
    meta = row["metadata"]
    return json.loads(meta) if isinstance(meta, str) else dict(meta or {})


def image_dict(row: asyncpg.Record) -> dict[str, Any]:
    return {
        "slug": row["slug"], "kind": row["kind"], "status": row["status"],
        "driver_strategy": row["driver_strategy"], "compatible_sku": row["compatible_sku"],
        "source_uri": row["source_uri"], "digest_sha256": row["digest_sha256"], "metadata": _meta(row),
        "created_at": row["created_at"].isoformat(), "updated_at": row["updated_at"].isoformat(),
    }


async def lock_image(conn: asyncpg.Connection, slug: str) -> asyncpg.Record | None:
    return await conn.fetchrow("SELECT * FROM os_images WHERE slug = $1 FOR UPDATE", slug)


async def node_caches(conn: asyncpg.Connection, slug: str) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT h.node_id, h.hostname, c.status, c.digest_sha256, c.expected_digest, c.local_path, c.verified_at, "
        "c.bytes_done, c.bytes_total, c.reason, c.updated_at FROM slice_hosts h "
        "LEFT JOIN node_image_cache c ON c.node_id = h.node_id AND c.slug = $1 ORDER BY h.node_id", slug)
    digest = await conn.fetchval("SELECT digest_sha256 FROM os_images WHERE slug = $1", slug)
    out = []
    for r in rows:
        d = dict(r)
        d["status"] = d["status"] or "absent"
        d["schedulable"] = node_schedulable(digest, (r["status"], r["digest_sha256"]) if r["status"] else None)
        for k in ("verified_at", "updated_at"):
            d[k] = d[k].isoformat() if d[k] else None
        out.append(d)
    return out


async def emit_activated(conn: asyncpg.Connection, writer: OutboxWriter, row: asyncpg.Record) -> None:
    seq = await conn.fetchval(
        "UPDATE os_images SET status = 'active', activation_seq = activation_seq + 1, updated_at = now() "
        "WHERE slug = $1 RETURNING activation_seq", row["slug"])
    meta = _meta(row)
    await writer.add(
        "image.activated",
        m.ImageActivated(slug=row["slug"], kind=row["kind"], sku=row["compatible_sku"],
                         digest_sha256=row["digest_sha256"], image_path=meta["image_path"],
                         source_uri=row["source_uri"]),
        aggregate_id=f"image:{row['slug']}",
        event_id=derived_event_id(activation_event_id_key(row["slug"], row["digest_sha256"], seq), "activated"),
    )
    log.info("image_activated", slug=row["slug"], digest=row["digest_sha256"], seq=seq)


async def emit_deactivated(writer: OutboxWriter, slug: str, reason: str) -> None:
    await writer.add("image.deactivated", m.ImageDeactivated(slug=slug, reason=reason), aggregate_id=f"image:{slug}")
    log.info("image_deactivated", slug=slug, reason=reason)


async def evaluate_gate(conn: asyncpg.Connection, writer: OutboxWriter, slug: str) -> bool:
    """Activate a published slice image once every known slice host verified the catalog digest."""
    row = await lock_image(conn, slug)
    if row is None or row["status"] != "published" or row["kind"] != "slice" or not row["digest_sha256"]:
        return False
    hosts = {r["node_id"] for r in await conn.fetch("SELECT node_id FROM slice_hosts")}
    caches = {r["node_id"]: (r["status"], r["digest_sha256"])
              for r in await conn.fetch("SELECT node_id, status, digest_sha256 FROM node_image_cache WHERE slug = $1", slug)}
    if not activation_ready(row["digest_sha256"], hosts, caches):
        return False
    await emit_activated(conn, writer, row)
    return True


async def set_cache(conn: asyncpg.Connection, writer: OutboxWriter, *, node_id: str, slug: str, status: str,
                    digest: str | None, expected: str | None, local_path: str | None, task_id: str | None = None,
                    done: int = 0, total: int = 0, reason: str | None = None) -> None:
    prev = await conn.fetchrow("SELECT status, digest_sha256 FROM node_image_cache WHERE node_id = $1 AND slug = $2",
                               node_id, slug)
    await conn.execute(
        "INSERT INTO node_image_cache (node_id, slug, status, digest_sha256, local_path, verified_at, expected_digest, "
        "task_id, bytes_done, bytes_total, reason, updated_at) "
        "VALUES ($1, $2, $3, $4, $5, CASE WHEN $3 = 'verified' THEN now() END, $6, $7, $8, $9, $10, now()) "
        "ON CONFLICT (node_id, slug) DO UPDATE SET status = EXCLUDED.status, digest_sha256 = EXCLUDED.digest_sha256, "
        "local_path = COALESCE(EXCLUDED.local_path, node_image_cache.local_path), "
        "verified_at = CASE WHEN EXCLUDED.status = 'verified' THEN now() ELSE NULL END, "
        "expected_digest = EXCLUDED.expected_digest, task_id = COALESCE(EXCLUDED.task_id, node_image_cache.task_id), "
        "bytes_done = EXCLUDED.bytes_done, bytes_total = EXCLUDED.bytes_total, reason = EXCLUDED.reason, "
        "updated_at = now()",
        node_id, slug, status, digest, local_path, expected, task_id, done, total, reason,
    )
    if prev is None or (prev["status"], prev["digest_sha256"]) != (status, digest):
        catalog_digest = await conn.fetchval("SELECT digest_sha256 FROM os_images WHERE slug = $1", slug)
        await writer.add(
            "image.node_cache_changed",
            m.ImageNodeCacheChanged(node_id=node_id, slug=slug, status=status, digest_sha256=digest,
                                    schedulable=node_schedulable(catalog_digest, (status, digest))),
            aggregate_id=f"image:{slug}",
        )


async def send_prewarm(conn: asyncpg.Connection, writer: OutboxWriter, row: asyncpg.Record, node_id: str,
                       cause: str) -> bool:
    """Ask one host to prewarm the image unless it already holds this digest verified."""
    meta = _meta(row)
    if not row["digest_sha256"] or not meta.get("artifact_ref") or not meta.get("blob_digest"):
        return False
    current = await conn.fetchrow("SELECT status, digest_sha256 FROM node_image_cache WHERE node_id = $1 AND slug = $2",
                                  node_id, row["slug"])
    if current and node_schedulable(row["digest_sha256"], (current["status"], current["digest_sha256"])):
        return False
    task_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpuaas:prewarm:{row['slug']}:{row['digest_sha256']}:{node_id}:{cause}"))
    task = m.ImageCachePrewarm(
        task_id=task_id, node_id=node_id, slug=row["slug"], digest_sha256=row["digest_sha256"],
        image_path=meta["image_path"], artifact_ref=meta["artifact_ref"], blob_digest=meta["blob_digest"],
        blob_size=meta["blob_size"], blob_media_type=meta["blob_media_type"], virtual_size=meta["virtual_size"],
        registry_tls=meta.get("registry_tls", "verify"),
    )
    await set_cache(conn, writer, node_id=node_id, slug=row["slug"], status="pulling", digest=None,
                    expected=row["digest_sha256"], local_path=meta["image_path"], task_id=task_id,
                    total=meta["blob_size"])
    await writer.add("image.cache_prewarm", task, aggregate_id=f"node:{node_id}",
                     event_id=derived_event_id(task_id, "prewarm"), node_id=node_id)
    return True


async def prewarm_everywhere(conn: asyncpg.Connection, writer: OutboxWriter, slug: str, cause: str) -> int:
    row = await lock_image(conn, slug)
    assert row is not None
    sent = 0
    for h in await conn.fetch("SELECT node_id FROM slice_hosts ORDER BY node_id"):
        sent += await send_prewarm(conn, writer, row, h["node_id"], cause)
    return sent


# --- admin operations ---------------------------------------------------------------------------


async def create_image(conn: asyncpg.Connection, req: ImageCreate, cache_dir: str) -> asyncpg.Record:
    image_path = req.image_path or (f"{cache_dir.rstrip('/')}/{req.slug}.raw" if req.kind == "slice"
                                    else f"custom/{req.slug}")
    row = await conn.fetchrow(
        "INSERT INTO os_images (slug, kind, status, driver_strategy, compatible_sku, metadata) "
        "VALUES ($1, $2, 'disabled', $3, $4, $5) ON CONFLICT (slug) DO NOTHING RETURNING *",
        req.slug, req.kind, req.driver_strategy, req.compatible_sku,
        json.dumps({**req.metadata, "image_path": image_path}),
    )
    if row is None:
        raise CatalogError(409, "exists", f"image {req.slug} already exists")
    return row


async def update_image(conn: asyncpg.Connection, writer: OutboxWriter, slug: str, req: ImageUpdate) -> asyncpg.Record:
    row = await lock_image(conn, slug)
    if row is None:
        raise CatalogError(404, "not_found", f"no image {slug}")
    meta = _meta(row)
    if req.metadata:
        bad = sorted(set(req.metadata) & set(PROTECTED_METADATA))
        if bad:
            raise CatalogError(422, "protected_metadata", f"{', '.join(bad)} come from builds, not from updates")
        meta.update(req.metadata)
    row = await conn.fetchrow(
        "UPDATE os_images SET compatible_sku = COALESCE($2, compatible_sku), "
        "driver_strategy = COALESCE($3, driver_strategy), metadata = $4, updated_at = now() WHERE slug = $1 RETURNING *",
        slug, req.compatible_sku, req.driver_strategy, json.dumps(meta),
    )
    if row["status"] == "active":
        await emit_activated(conn, writer, row)  # consumers learn the new SKU / strategy
        row = await lock_image(conn, slug)
    return row


async def enable_image(conn: asyncpg.Connection, writer: OutboxWriter, slug: str) -> asyncpg.Record:
    row = await lock_image(conn, slug)
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
    if row["kind"] == "host" or not _meta(row).get("artifact_ref"):
        # Host images live in MAAS and seed-style rows have no artifact to prewarm: nothing to gate on.
        await emit_activated(conn, writer, row)
    else:
        await conn.execute("UPDATE os_images SET status = 'published', updated_at = now() WHERE slug = $1", slug)
        if not await evaluate_gate(conn, writer, slug):
            await prewarm_everywhere(conn, writer, slug, cause=f"enable:{uuid.uuid4()}")
    return await lock_image(conn, slug)


async def disable_image(conn: asyncpg.Connection, writer: OutboxWriter, slug: str) -> asyncpg.Record:
    row = await lock_image(conn, slug)
    if row is None:
        raise CatalogError(404, "not_found", f"no image {slug}")
    if row["status"] != "disabled":
        await conn.execute("UPDATE os_images SET status = 'disabled', updated_at = now() WHERE slug = $1", slug)
        await emit_deactivated(writer, slug, "disabled by an operator")
    return await lock_image(conn, slug)


async def delete_image(conn: asyncpg.Connection, writer: OutboxWriter, slug: str) -> None:
    row = await lock_image(conn, slug)
    if row is None:
        raise CatalogError(404, "not_found", f"no image {slug}")
    await conn.execute("DELETE FROM os_images WHERE slug = $1", slug)
    await emit_deactivated(writer, slug, "deleted from the catalog")


# --- bus handlers ---------------------------------------------------------------------------------


async def on_enrolled(conn: asyncpg.Connection, writer: OutboxWriter, ev: m.NodeEnrolled, event_id: str) -> int:
    if ev.kind != "slice_host":
        return 0
    await conn.execute(
        "INSERT INTO slice_hosts (node_id, hostname) VALUES ($1, $2) ON CONFLICT (node_id) DO UPDATE "
        "SET hostname = EXCLUDED.hostname, last_enrolled_at = now()", ev.node_id, ev.hostname)
    sent = 0
    for row in await conn.fetch("SELECT slug FROM os_images WHERE kind = 'slice' AND status IN ('published', 'active') "
                                "ORDER BY slug"):
        locked = await lock_image(conn, row["slug"])
        sent += await send_prewarm(conn, writer, locked, ev.node_id, cause=f"enrolled:{event_id}")
    return sent


async def on_cache_reported(conn: asyncpg.Connection, writer: OutboxWriter, ev: m.NodeImageCacheReported) -> None:
    row = await lock_image(conn, ev.slug)
    if row is None or row["digest_sha256"] != ev.expected_digest:
        log.info("stale_cache_report_ignored", slug=ev.slug, node_id=ev.node_id, expected=ev.expected_digest)
        return
    status = ev.status
    if status == "pulling":
        current = await conn.fetchrow("SELECT status, task_id FROM node_image_cache WHERE node_id = $1 AND slug = $2",
                                      ev.node_id, ev.slug)
        if current and current["task_id"] == ev.task_id and current["status"] in ("verified", "mismatch", "failed"):
            return  # progress overtaken by the task's own verdict
    if status == "verified" and ev.digest_sha256 != row["digest_sha256"]:
        status = "mismatch"  # never trust a verdict that disagrees with its own digest
    await set_cache(conn, writer, node_id=ev.node_id, slug=ev.slug, status=status, digest=ev.digest_sha256,
                    expected=ev.expected_digest, local_path=ev.local_path, task_id=ev.task_id, done=ev.bytes_done,
                    total=ev.bytes_total, reason=ev.reason)
    if status == "verified":
        await evaluate_gate(conn, writer, ev.slug)
