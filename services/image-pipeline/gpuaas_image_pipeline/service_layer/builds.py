"""Build and publish: source qcow2 -> customise -> sparse raw (qemu-img) -> packed artifact (raw sha256
and blob sha256 in one pass) -> OCI registry (oras) -> catalog row `published` -> prewarm on every slice
host. Activation follows from the node reports (see catalog.evaluate_gate).

A build runs as a background task of the pipeline replica that started it; each phase is recorded on the
build row and announced as `image.build_progress`. That replica holds the build's lease (migration 005)
and renews it while the build runs; every write of the build is fenced on it. A build whose lease has run
out lost its process: any replica marks it failed (`recover`, at start-up and then periodically in
`watch`), so a replica's restart fails its own interrupted builds but never a live build of another one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpuaas_common.bus import Bus
from gpuaas_common.cancellation import stop_if_cancelled
from gpuaas_common.contract import messages as m
from gpuaas_common.db import DB_UNAVAILABLE
from gpuaas_common.logging import bound_context, get_logger

from ..adapters import base_image, customise_chroot, paths, qemu, registry, sparse
from ..domain.catalog import ArtifactRef, BuildRequest, ImageCreate, default_tag
from ..settings import ImagePipelineSettings
from . import catalog
from .catalog import CatalogError, Uow
from .ports import BuildLeases, Row, UnitOfWorkFactory

log = get_logger(__name__)
RUNNING = ("queued", "customising", "converting", "packing", "pushing")
PROGRESS_INTERVAL_S = 0.25
# A build's lease: renewed every quarter of it while the build runs, so only a process that is gone (or
# cut off from the database for that long) lets it run out.
BUILD_LEASE_S = 30.0
INTERRUPTED = "interrupted: the pipeline replica running it stopped mid-build"


class BuildTakenOver(Exception):
    """The build's lease ran out and another replica failed it: this run's results are not recorded."""


def build_dict(row: Row) -> dict[str, Any]:
    # The lease is how replicas share builds, not part of a build as the API describes it.
    d = {k: v for k, v in dict(row).items() if k not in ("lease_owner", "lease_until")}
    for k in ("created_at", "updated_at"):
        d[k] = d[k].isoformat()
    return d


class BuildRunner:
    """`uows`: a unit of work for each of a build's steps; `leases`: where a running build's lease is renewed
    (adapters/repository.py's `unit_of_work` and `PoolLeases`, wired by entrypoints/build_runner.py)."""

    def __init__(
        self,
        uows: UnitOfWorkFactory,
        leases: BuildLeases,
        bus: Bus | None,
        settings: ImagePipelineSettings,
        *,
        lease_s: float = BUILD_LEASE_S,
    ) -> None:
        self._uows = uows
        self.leases = leases
        self.bus = bus
        self.settings = settings
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_s
        self.limits = qemu.ToolLimits(settings.image_tool_max_memory_mib << 20, settings.image_tool_max_cpu_s)
        keyring = settings.image_base_keyring
        self.fetch_policy = base_image.FetchPolicy(
            keyring=Path(keyring) if keyring else None, loopback_lab=settings.image_base_loopback_lab
        )

    def _uow(self, correlation_id: str | None = None) -> Uow:
        return self._uows(correlation_id)

    async def recover(self) -> int:
        """Fail the running builds whose lease has run out; how many."""
        async with self._uow() as uow:
            count = await uow.repos.builds.fail_orphaned(list(RUNNING), INTERRUPTED)
            await uow.commit()
        return count

    async def watch(self) -> None:
        """Take over (fail) the builds of replicas that died, for as long as this one runs."""
        while True:
            await asyncio.sleep(self.lease_s / 2)
            stop_if_cancelled()
            try:
                if count := await self.recover():
                    log.warning("builds_interrupted", count=count)
            except DB_UNAVAILABLE as exc:
                log.warning("build_recovery_failed", error=repr(exc)[:300])

    def source_path(self, source: str) -> Path:
        """The request's source with its links resolved, inside GPUAAS_IMAGE_SOURCE_DIRS (N15), or a 422."""
        try:
            return paths.confined(
                source, paths.dirs_setting(self.settings.image_source_dirs), what="source", code="source_refused"
            )
        except paths.PathRefused as exc:
            raise CatalogError(422, "source_refused", str(exc)) from None

    # --- planning ---------------------------------------------------------------------------------

    def plan(self, slug: str, build_id: str, req: BuildRequest, reuse: Row | None) -> dict[str, Any]:
        s = self.settings
        tag = req.tag or s.registry_tag or default_tag(datetime.now(timezone.utc))
        namespace = (req.namespace or s.registry_namespace).strip("/")
        catalog_host = s.registry_host or "<GPUAAS_REGISTRY_HOST unset>"
        ref = ArtifactRef(catalog_host, f"{namespace}/{slug}", tag)
        workdir = Path(s.image_build_dir) / build_id
        customiser = qemu.CUSTOMISERS[req.customise or s.image_customise]
        packages = req.packages or [p for p in s.image_install_packages.split(",") if p]
        steps: list[str] = []
        if reuse is None:
            source = req.source
            if req.base_url:
                source = f"{s.image_base_cache_dir.rstrip('/')}/sha256-<digest>"
                trusted = [f"the pinned sha256 {req.base_sha256}"] if req.base_sha256 else []
                if req.checksums_url:
                    trusted.append(f"its entry in {req.checksums_url} (signature {req.checksums_url}.gpg)")
                steps += [
                    f"fetch {req.base_url} unless {s.image_base_cache_dir} holds it; its sha256 must match "
                    + " and ".join(trusted)
                ]
            steps += [
                f"qemu-img info -f {req.source_format} {source}: refused if it names a backing or data file",
                f"qemu-img convert -f {req.source_format} -O qcow2 {source} {workdir / 'work.qcow2'}",
            ]
            if req.resize_gib:
                steps += [f"qemu-img resize -f qcow2 {workdir / 'work.qcow2'} {req.resize_gib}G"]
            steps += customiser.plan(workdir / "work.qcow2", packages)
            steps += [f"qemu-img convert -p -f qcow2 -O raw -S 4k {workdir / 'work.qcow2'} {workdir / 'image.raw'}"]
            if getattr(customiser, "installs_packages", False) and packages:
                steps += [
                    f"read var/lib/dpkg/status back from {workdir / 'image.raw'} (mounted read-only): "
                    f"{', '.join(packages)} installed, versions recorded"
                ]
            steps += [f"pack sparse extents + sha256 -> {workdir / 'image.gpsparse'} ({sparse.MEDIA_TYPE})"]
        else:
            steps += [
                f"reuse artifact of build {reuse['build_id']}: {reuse['artifact_path']} "
                f"(raw sha256 {reuse['raw_sha256']})"
            ]
        steps.append(
            f"push to {s.registry_push_host or catalog_host}/{ref.repository}:{tag} "
            f"(tls {s.registry_tls_mode}) with oras"
        )
        if req.update_catalog:
            steps += [
                f"catalog {slug}: source_uri {ref.uri}@<manifest digest>, status published",
                "send image.cache_prewarm to every enrolled slice host; activate when all verify",
            ]
        return {
            "build_id": build_id,
            "slug": slug,
            "tag": tag,
            "namespace": namespace,
            "artifact_ref": ref.uri,
            "push_endpoint": s.registry_push_host or catalog_host,
            "catalog_host": catalog_host,
            "tls_mode": s.registry_tls_mode,
            "customise": customiser.name,
            "packages": packages,
            **({"base_url": req.base_url, "checksums_url": req.checksums_url} if req.base_url else {}),
            "reuse_build_id": reuse["build_id"] if reuse is not None else None,
            "update_catalog": req.update_catalog,
            "workdir": str(workdir),
            "steps": steps,
        }

    # --- start ------------------------------------------------------------------------------------

    async def start(self, slug: str, req: BuildRequest) -> dict[str, Any]:
        """Plan (and unless a dry run, queue and launch) a build in a unit of work of its own."""
        async with self._uow(correlation_id=f"build:{slug}") as uow:
            build, launch = await self.begin(uow, slug, req)
            await uow.commit()
        if launch is not None:
            launch()
        return build

    async def begin(self, uow: Uow, slug: str, req: BuildRequest) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """The build row, written in the caller's unit of work, and what starts the build: the caller
        calls it once that unit of work committed (a rolled-back request must not leave a build running)."""
        try:
            req.check(loopback_http=self.settings.image_base_loopback_lab)
        except ValueError as exc:
            raise CatalogError(422, "invalid_build", str(exc)) from None
        if req.source:
            self.source_path(req.source)
        if req.source and not req.dry_run and not await asyncio.to_thread(Path(req.source).is_file):
            raise CatalogError(422, "source_missing", f"source image {req.source} does not exist")
        if not self.settings.registry_host and not req.dry_run:
            raise CatalogError(409, "no_registry", "GPUAAS_REGISTRY_HOST is not configured")
        build_id = str(uuid.uuid4())
        # A slug the catalog does not know gets its row when the build publishes (_catalog), not now: a build
        # that fails must leave no half-written image behind.
        row = await uow.repos.images.lock(slug)
        if row is not None and row["kind"] != "slice":
            raise CatalogError(409, "not_a_slice_image", f"{slug} is a {row['kind']} image")
        reuse = None
        if req.reuse_build_id:
            reuse = await uow.repos.builds.get(req.reuse_build_id)
            if reuse is None or not reuse["artifact_path"] or not reuse["raw_sha256"]:
                raise CatalogError(409, "nothing_to_reuse", f"build {req.reuse_build_id} left no artifact")
            if not await asyncio.to_thread(Path(reuse["artifact_path"]).is_file):
                raise CatalogError(409, "nothing_to_reuse", f"{reuse['artifact_path']} is gone")
        plan = self.plan(slug, build_id, req, reuse)
        if not req.dry_run and await uow.repos.builds.any_in(slug, list(RUNNING)):
            raise CatalogError(409, "build_running", f"a build of {slug} is already running")
        row = await uow.repos.builds.insert(
            build_id,
            slug,
            "planned" if req.dry_run else "queued",
            req.source or req.base_url,
            req.model_dump(mode="json"),
            req.reuse_build_id,
            plan,
            lease_owner=None if req.dry_run else self.owner,
            lease_s=self.lease_s,
        )
        if req.dry_run:
            return build_dict(row), None

        def launch() -> None:
            task = asyncio.create_task(self._run(build_id, slug, req, plan, reuse))
            self.tasks[build_id] = task
            task.add_done_callback(lambda _t: self.tasks.pop(build_id, None))

        return build_dict(row), launch

    # --- run --------------------------------------------------------------------------------------

    async def _status(self, build_id: str, status: str, **fields: Any) -> None:
        async with self._uow(correlation_id=build_id) as uow:
            if not await uow.repos.builds.update(build_id, fence_owner=self.owner, status=status, **fields):
                raise BuildTakenOver(build_id)
            await uow.commit()

    async def _renew(self, build_id: str, done: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(done.wait(), timeout=self.lease_s / 4)
                return
            except TimeoutError:
                pass  # still building: time to renew
            try:
                if not await self.leases.renew(build_id, self.owner, self.lease_s):
                    log.warning("image_build_lease_lost")
                    return
            except DB_UNAVAILABLE as exc:
                # Tried again at the next beat; should the lease run out meanwhile, the fence holds.
                log.warning("image_build_lease_renew_failed", error=repr(exc)[:300])

    def _progress(self, build_id: str, slug: str, phase: str) -> Callable[..., None]:
        loop = asyncio.get_running_loop()
        last = [0.0]

        def report(done: int, total: int, force: bool = False) -> None:
            now = time.monotonic()
            if self.bus is None or (not force and now - last[0] < PROGRESS_INTERVAL_S and done < total):
                return
            last[0] = now
            ev = m.ImageBuildProgress(
                build_id=build_id, slug=slug, phase=phase, bytes_done=max(done, 0), bytes_total=max(total, 0)
            )
            coro = self.bus.publish("image.build_progress", ev, correlation_id=build_id)
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                asyncio.ensure_future(_quiet(coro))
            else:
                asyncio.run_coroutine_threadsafe(_quiet(coro), loop)

        return report

    async def _run(self, build_id: str, slug: str, req: BuildRequest, plan: dict[str, Any], reuse: Row | None) -> None:
        with bound_context(build_id=build_id, slug=slug):
            started = time.monotonic()
            done = asyncio.Event()
            renewing = asyncio.create_task(self._renew(build_id, done))
            try:
                await self._build_and_publish(build_id, slug, req, plan, reuse)
            except BuildTakenOver:
                log.warning("image_build_taken_over")
                return
            except Exception as exc:
                log.error("image_build_failed", error=repr(exc), exc_info=True)
                try:
                    await self._status(
                        build_id,
                        "failed",
                        error=f"{type(exc).__name__}: {exc}"[:4000],
                        lease_owner=None,
                        lease_until=None,
                    )
                except BuildTakenOver:
                    return
                self._progress(build_id, slug, "failed")(0, 0, True)
                return
            finally:
                # Stopped between two renewals, never inside one. A cancelled build (the process is
                # stopping) keeps its lease until it runs out, then a replica fails it.
                done.set()
                await renewing
            log.info("image_build_published", seconds=round(time.monotonic() - started, 3))

    async def _build_and_publish(
        self, build_id: str, slug: str, req: BuildRequest, plan: dict[str, Any], reuse: Row | None
    ) -> None:
        s = self.settings
        workdir = Path(plan["workdir"])
        await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
        installed: dict[str, str] | None = None
        if reuse is None:
            work = workdir / "work.qcow2"
            limits = self.limits
            if req.base_url:
                assert req.checksums_url or req.base_sha256
                await self._status(build_id, "customising")
                fetched = await base_image.fetch_base_image(
                    req.base_url,
                    req.checksums_url,
                    Path(s.image_base_cache_dir),
                    pinned_sha256=req.base_sha256,
                    policy=self.fetch_policy,
                    progress=self._progress(build_id, slug, "fetch"),
                )
                self._progress(build_id, slug, "fetch")(1, 1, True)
                log.info("image_base_fetched", sha256=fetched.sha256, downloaded=fetched.downloaded)
                source = fetched.path
                # Refused (a backing file, a data file, not the format named) before any tool converts it.
                await qemu.checked_input(source, req.source_format, limits)
            else:
                assert req.source
                # Resolved again: a link swapped since the request was taken must not lead outside.
                source = await asyncio.to_thread(self.source_path, req.source)
                await qemu.checked_input(source, req.source_format, limits)
                await self._status(build_id, "customising")
            self._progress(build_id, slug, "customise")(0, 1, True)
            # A private qcow2 copy: the source stays pristine and the customiser may write freely.
            await qemu.convert_to_qcow2(source, req.source_format, work, limits)
            if req.resize_gib:
                await base_image.resize(work, "qcow2", req.resize_gib)
            customiser = qemu.CUSTOMISERS[plan["customise"]]
            await customiser.customise(
                work, plan["packages"], {"build_id": build_id, "slug": slug, "built_at": plan["tag"]}
            )
            self._progress(build_id, slug, "customise")(1, 1, True)
            await self._status(build_id, "converting")
            raw = workdir / "image.raw"
            await qemu.convert_to_raw(work, "qcow2", raw, self._progress(build_id, slug, "convert"), limits)
            work.unlink()
            if getattr(customiser, "installs_packages", False) and plan["packages"]:
                # What the artifact holds, not what apt said: a package the install did not leave configured
                # fails the build here rather than on a customer's guest.
                self._progress(build_id, slug, "verify")(0, 1, True)
                installed = await customise_chroot.installed_versions(raw, plan["packages"], workdir)
                self._progress(build_id, slug, "verify")(1, 1, True)
                log.info("image_packages_verified", packages=installed)
            await self._status(build_id, "packing", raw_path=str(raw))
            artifact = workdir / "image.gpsparse"
            packed = await asyncio.to_thread(sparse.pack, raw, artifact, self._progress(build_id, slug, "pack"))
            await self._status(
                build_id,
                "pushing",
                raw_sha256=packed.raw_sha256,
                virtual_size=packed.virtual_size,
                data_bytes=packed.data_bytes,
                artifact_path=str(artifact),
                blob_digest=f"sha256:{packed.blob_sha256}",
                blob_size=packed.blob_size,
            )
            raw_sha256, blob_sha256, blob_size, virtual_size = (
                packed.raw_sha256,
                packed.blob_sha256,
                packed.blob_size,
                packed.virtual_size,
            )
        else:
            artifact = Path(reuse["artifact_path"])
            raw_sha256, blob_sha256 = reuse["raw_sha256"], reuse["blob_digest"].removeprefix("sha256:")
            blob_size, virtual_size = reuse["blob_size"], reuse["virtual_size"]
            await self._status(
                build_id,
                "pushing",
                raw_path=reuse["raw_path"],
                raw_sha256=raw_sha256,
                virtual_size=virtual_size,
                data_bytes=reuse["data_bytes"],
                artifact_path=str(artifact),
                blob_digest=reuse["blob_digest"],
                blob_size=blob_size,
            )
        ref = ArtifactRef.parse(plan["artifact_ref"])
        push_host = s.registry_push_host or s.registry_host
        assert push_host is not None  # begin() refuses a build when no registry is configured
        pushed = await asyncio.to_thread(
            registry.push_artifact,
            push_host=push_host,
            repository=ref.repository,
            tag=ref.tag,
            tls_mode=s.registry_tls_mode,
            blob=artifact,
            blob_digest=blob_sha256,
            blob_size=blob_size,
            media_type=sparse.MEDIA_TYPE,
            title=f"{slug}.raw",
            config={
                "slug": slug,
                "digest_sha256": raw_sha256,
                "virtual_size": virtual_size,
                "build_id": build_id,
                "format": sparse.MEDIA_TYPE,
            },
            annotations={
                "org.opencontainers.image.created": datetime.now(timezone.utc).isoformat(),
                "org.opencontainers.image.title": slug,
                "io.gpuaas.image.sha256": raw_sha256,
                "io.gpuaas.build.id": build_id,
            },
            chunk_size=s.registry_chunk_mib << 20,
            progress=self._progress(build_id, slug, "push"),
        )
        artifact_ref = ArtifactRef(ref.host, ref.repository, ref.tag, pushed.manifest_digest).uri
        async with self._uow(correlation_id=build_id) as uow:
            if not await uow.repos.builds.update(
                build_id,
                fence_owner=self.owner,
                status="published",
                artifact_ref=artifact_ref,
                manifest_digest=pushed.manifest_digest,
                lease_owner=None,
                lease_until=None,
            ):
                raise BuildTakenOver(build_id)
            if req.update_catalog:
                await self._catalog(
                    uow, slug, build_id, raw_sha256, artifact_ref, blob_sha256, blob_size, virtual_size, installed, req
                )
            await uow.commit()
        self._progress(build_id, slug, "published")(1, 1, True)

    async def _catalog(
        self,
        uow: Uow,
        slug: str,
        build_id: str,
        raw_sha256: str,
        artifact_ref: str,
        blob_sha256: str,
        blob_size: int,
        virtual_size: int,
        installed: dict[str, str] | None,
        req: BuildRequest,
    ) -> None:
        row = await uow.repos.images.lock(slug)
        if row is None:
            # The first build of this slug published: the image exists from now on, with the request's defaults.
            await catalog.create_image(
                uow,
                ImageCreate(slug=slug, compatible_sku=req.compatible_sku, driver_strategy=req.driver_strategy),
                self.settings.image_cache_dir,
            )
            row = await uow.repos.images.lock(slug)
            assert row is not None
        meta = catalog._meta(row)
        meta.update(
            artifact_ref=artifact_ref,
            blob_digest=f"sha256:{blob_sha256}",
            blob_size=blob_size,
            blob_media_type=sparse.MEDIA_TYPE,
            virtual_size=virtual_size,
            build_id=build_id,
            registry_tls=self.settings.registry_tls_mode,
        )
        if installed is not None:
            meta["installed_packages"] = installed
        meta.setdefault("image_path", f"{self.settings.image_cache_dir.rstrip('/')}/{slug}.raw")
        same = row["digest_sha256"] == raw_sha256
        # Same content republished keeps its status (an active image stays active); a new digest has to be
        # verified on every host again, and the cache path is shared, so the old digest stops being usable.
        status = row["status"] if same and row["status"] in ("active", "published") else "published"
        await uow.repos.images.update(
            slug, digest_sha256=raw_sha256, source_uri=artifact_ref, metadata=meta, status=status
        )
        if row["status"] == "active" and status != "active":
            await catalog.emit_deactivated(uow, slug, f"new digest {raw_sha256} is being prewarmed")
        await uow.events.add(
            "image.published",
            m.ImagePublished(
                slug=slug,
                build_id=build_id,
                digest_sha256=raw_sha256,
                source_uri=artifact_ref,
                image_path=meta["image_path"],
            ),
            aggregate_id=f"image:{slug}",
        )
        sent = await catalog.prewarm_everywhere(uow, slug, cause=f"build:{build_id}")
        activated = await catalog.evaluate_gate(uow, slug)
        log.info("image_catalogued", digest=raw_sha256, ref=artifact_ref, prewarm_tasks=sent, activated=activated)


async def _quiet(coro: Awaitable[Any]) -> None:
    try:
        await coro
    except Exception as exc:  # progress is best effort; the build row is the record
        log.warning("build_progress_not_published", error=repr(exc))
