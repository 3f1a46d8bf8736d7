"""`image.cache_prewarm`: make sure this host's cache holds an image with the catalog digest, report the outcome.

A file already in the cache (pulled earlier, or placed there by the host's provisioning, as seeded images
are) is hashed first and counts when it matches: nothing is pulled then. Otherwise the artifact is pulled
and verified; an image without an artifact can only be checked.

The report is `node.image_cache_reported`: `pulling` with byte counts while a transfer runs (at most a
few per second), then `verified`, `mismatch` (the bytes do not hash to the catalog digest; the
existing cache file is left untouched), `failed` (transfer broke; nothing installed) or `absent` (not in
the cache, and no artifact to pull it from).
A verified file is remembered in the agent's state store so provisioning does not hash it again.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import Any

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.digests import sha256_file
from gpuaas_common.logging import get_logger

from ..adapters import image_cache
from ..adapters.state_store import StateStore
from .host_paths import HostPaths

log = get_logger(__name__)

Publish = Callable[..., Awaitable[Any]]
PROGRESS_INTERVAL_S = 0.25


class ImagePrewarmer:
    def __init__(
        self,
        node_id: str,
        paths: HostPaths,
        store: StateStore,
        publish: Publish,
        *,
        image_cache_dir: str,
        registry_endpoint: str | None = None,
    ) -> None:
        """`registry_endpoint` (host:port) replaces the artifact's registry host, e.g. a site-local mirror."""
        self.node_id = node_id
        self.paths = paths
        self.store = store
        self.publish = publish
        self.image_cache_dir = PurePosixPath(image_cache_dir)
        self.registry_endpoint = registry_endpoint
        # One pull per cache file at a time; a redelivered task waits and then finds the file verified.
        self._locks: dict[str, asyncio.Lock] = {}

    async def on_task(self, ctx: HandlerContext) -> None:
        task: m.ImageCachePrewarm = ctx.payload
        if task.node_id != self.node_id:
            raise PermanentError("schema_invalid", f"task for {task.node_id} delivered to {self.node_id}")
        target = PurePosixPath(task.image_path)
        if not target.is_absolute() or ".." in target.parts or target.parent != self.image_cache_dir:
            # A task must never make the agent write outside its image cache.
            raise PermanentError("schema_invalid", f"{task.image_path} is not a file in {self.image_cache_dir}")
        async with self._locks.setdefault(task.image_path, asyncio.Lock()):
            report = await self.prewarm(task, causation_id=ctx.envelope.event_id)
        await self._report(report, ctx.envelope.event_id, final=True)

    async def prewarm(self, task: m.ImageCachePrewarm, causation_id: str | None = None) -> m.NodeImageCacheReported:
        dest = self.paths.host(task.image_path)
        if self._already_verified(dest, task.digest_sha256):
            log.info("image_cache_hit", slug=task.slug, path=task.image_path)
            return self._make(task, "verified", digest=task.digest_sha256, done=task.blob_size)
        held = await self._hash_held(dest)
        if held == task.digest_sha256:
            log.info("image_cache_verified_in_place", slug=task.slug, path=task.image_path)
            return self._make(task, "verified", digest=held, done=task.blob_size)
        if task.artifact_ref is None or task.blob_digest is None:
            if held is None:
                log.warning("image_cache_absent", slug=task.slug, path=task.image_path)
                return self._make(task, "absent", reason="not in this host's image cache, and no artifact to pull")
            log.error("image_cache_mismatch", slug=task.slug, path=task.image_path, digest=held)
            return self._make(
                task,
                "mismatch",
                digest=held,
                reason="the cached file does not hash to the catalog digest, and there is no artifact to pull",
            )
        return await self._pull(task, dest, causation_id)

    async def _pull(self, task: m.ImageCachePrewarm, dest: Path, causation_id: str | None) -> m.NodeImageCacheReported:
        assert task.artifact_ref is not None and task.blob_digest is not None
        loop = asyncio.get_running_loop()
        last = [0.0]
        pending: list[Any] = []

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_INTERVAL_S:
                last[0] = now
                ev = self._make(task, "pulling", done=done)
                pending.append(asyncio.run_coroutine_threadsafe(self._report(ev, causation_id, final=False), loop))

        await self._report(self._make(task, "pulling"), causation_id, final=False)
        log.info("image_pull_started", slug=task.slug, ref=task.artifact_ref, bytes=task.blob_size)
        started = time.monotonic()
        try:
            outcome = await asyncio.to_thread(
                image_cache.pull_into_cache,
                artifact_ref=task.artifact_ref,
                blob_digest=task.blob_digest,
                blob_size=task.blob_size,
                expected_raw_sha256=task.digest_sha256,
                dest=dest,
                tls_mode=task.registry_tls,
                endpoint=self.registry_endpoint,
                progress=progress,
            )
        except image_cache.PullError as exc:
            log.error("image_pull_failed", slug=task.slug, reason=str(exc))
            return self._make(task, "failed", reason=str(exc))
        finally:
            # Progress must not overtake the verdict on the bus.
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending), return_exceptions=True)
        elapsed = time.monotonic() - started
        if outcome.status == "verified":
            st = await asyncio.to_thread(os.stat, dest)
            self.store.remember_digest(str(dest), task.digest_sha256, st.st_size, st.st_mtime)
            log.info(
                "image_cache_verified",
                slug=task.slug,
                path=task.image_path,
                seconds=round(elapsed, 3),
                bytes=outcome.bytes_received,
            )
        else:
            log.error("image_cache_mismatch", slug=task.slug, reason=outcome.reason, digest=outcome.raw_sha256)
        return self._make(
            task, outcome.status, digest=outcome.raw_sha256, done=outcome.bytes_received, reason=outcome.reason
        )

    async def _hash_held(self, dest: Path) -> str | None:
        """The digest of the file the cache holds (None: no file). It is remembered when the file did not
        change while it was hashed, so the next task or provision does not hash it again."""
        try:
            st = await asyncio.to_thread(os.stat, dest)
        except FileNotFoundError:
            return None
        known = self.store.verified_digest(str(dest), st.st_size, st.st_mtime)
        if known is not None:
            return known
        try:
            digest, unchanged = await asyncio.to_thread(_hash_unchanged, dest, st.st_size, st.st_mtime)
        except FileNotFoundError:
            return None
        if unchanged:
            self.store.remember_digest(str(dest), digest, st.st_size, st.st_mtime)
        return digest

    def _already_verified(self, dest: Path, digest: str) -> bool:
        try:
            st = dest.stat()
        except FileNotFoundError:
            return False
        return self.store.verified_digest(str(dest), st.st_size, st.st_mtime) == digest

    def _make(
        self,
        task: m.ImageCachePrewarm,
        status: str,
        *,
        digest: str | None = None,
        done: int = 0,
        reason: str | None = None,
    ) -> m.NodeImageCacheReported:
        return m.NodeImageCacheReported(
            task_id=task.task_id,
            node_id=self.node_id,
            slug=task.slug,
            status=status,
            expected_digest=task.digest_sha256,
            digest_sha256=digest,
            local_path=task.image_path,
            bytes_done=done,
            bytes_total=task.blob_size,
            reason=reason[:2000] if reason else None,
        )

    async def _report(self, ev: m.NodeImageCacheReported, causation_id: str | None, *, final: bool) -> None:
        # A final report repeats with the same id for the same outcome; a different outcome is new news.
        event_id = derived_event_id(ev.task_id, f"cache:{ev.status}:{ev.digest_sha256}") if final else None
        try:
            await self.publish(
                "node.image_cache_reported",
                ev,
                correlation_id=ev.task_id,
                causation_id=causation_id,
                event_id=event_id,
                node_id=self.node_id,
            )
        except Exception as exc:
            if final:
                raise
            log.warning("image_progress_not_published", error=repr(exc))


def _hash_unchanged(path: Path, size: int, mtime: float) -> tuple[str, bool]:
    digest = sha256_file(path)
    after = path.stat()
    return digest, (after.st_size, after.st_mtime) == (size, mtime)
