"""Admin HTTP API of the image catalog (see ../../openapi.yaml). Bearer token; JSON in and out."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
from aiohttp import web
from pydantic import BaseModel, ValidationError

from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import OutboxWriter

from ..adapters.host_image import HostImage, build_rootfs_tgz
from ..domain.catalog import (
    BuildRequest,
    HostUploadRequest,
    ImageCreate,
    ImageUpdate,
    ProfileImageRequest,
    host_tgz_name,
)
from ..service_layer import catalog, host_images
from ..service_layer.builds import BuildRunner, build_dict
from ..service_layer.catalog import CatalogError, image_dict
from ..settings import ImagePipelineSettings

log = get_logger(__name__)
SCHEMA = "image_pipeline"
# The catalog's slug rule, checked before a slug becomes part of a file name.
SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


def _error(status: int, code: str, reason: str) -> web.Response:
    return web.json_response({"error": code, "reason": reason}, status=status)


async def _body(request: web.Request, model: type[BaseModel]) -> BaseModel:
    try:
        data = await request.json() if request.can_read_body else {}
    except ValueError:
        raise CatalogError(400, "not_json", "request body is not JSON") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()[:8])
        raise CatalogError(422, "invalid", detail) from None


class AdminApi:
    def __init__(self, pool: asyncpg.Pool, runner: BuildRunner, settings: ImagePipelineSettings) -> None:
        self.pool = pool
        self.runner = runner
        self.settings = settings
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        token = self.settings.admin_token.get_secret_value() if self.settings.admin_token else ""
        given = request.headers.get("Authorization", "")
        if not token or not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return _error(401, "unauthorized", "a valid bearer token is required")
        try:
            return await handler(request)
        except CatalogError as exc:
            return _error(exc.status, exc.code, exc.reason)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        r = app.router
        r.add_get("/v1/images", self.list_images)
        r.add_post("/v1/images", self.create_image)
        r.add_get("/v1/images/{slug}", self.get_image)
        r.add_patch("/v1/images/{slug}", self.update_image)
        r.add_delete("/v1/images/{slug}", self.delete_image)
        r.add_post("/v1/images/{slug}/enable", self.enable_image)
        r.add_post("/v1/images/{slug}/disable", self.disable_image)
        r.add_post("/v1/images/{slug}/prewarm", self.prewarm_image)
        r.add_post("/v1/images/{slug}/builds", self.start_build)
        r.add_get("/v1/images/{slug}/builds", self.list_builds)
        r.add_get("/v1/builds/{build_id}", self.get_build)
        r.add_post("/v1/images/{slug}/host-upload", self.host_upload)
        r.add_post("/v1/images/{slug}/maas-profile", self.maas_profile)
        r.add_get("/v1/images/{slug}/maas-requests", self.list_maas_requests)
        r.add_get("/v1/maas-requests/{operation_id}", self.get_maas_request)
        return app

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.admin_host, self.settings.admin_port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("admin_api_listening", host=self.settings.admin_host, port=self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    def _writer(self, conn: asyncpg.Connection, what: str) -> OutboxWriter:
        return OutboxWriter(conn, SCHEMA, "image-pipeline", correlation_id=f"admin:{what}")

    # --- handlers -------------------------------------------------------------------------------

    async def list_images(self, request: web.Request) -> web.Response:
        rows = await self.pool.fetch("SELECT * FROM os_images ORDER BY slug")
        return web.json_response({"images": [image_dict(r) for r in rows]})

    async def _full(self, conn: asyncpg.Connection, slug: str) -> dict:
        row = await conn.fetchrow("SELECT * FROM os_images WHERE slug = $1", slug)
        if row is None:
            raise CatalogError(404, "not_found", f"no image {slug}")
        out = image_dict(row)
        out["nodes"] = await catalog.node_caches(conn, slug)
        last = await conn.fetchrow("SELECT * FROM builds WHERE slug = $1 ORDER BY created_at DESC LIMIT 1", slug)
        out["last_build"] = build_dict(last) if last else None
        return out

    async def get_image(self, request: web.Request) -> web.Response:
        async with self.pool.acquire() as conn:
            return web.json_response(await self._full(conn, request.match_info["slug"]))

    async def create_image(self, request: web.Request) -> web.Response:
        req = await _body(request, ImageCreate)
        async with self.pool.acquire() as conn, conn.transaction():
            row = await catalog.create_image(conn, req, self.settings.image_cache_dir)  # type: ignore[arg-type]
        log.info("image_created", slug=row["slug"])
        return web.json_response(image_dict(row), status=201)

    async def update_image(self, request: web.Request) -> web.Response:
        req = await _body(request, ImageUpdate)
        slug = request.match_info["slug"]
        async with self.pool.acquire() as conn, conn.transaction():
            row = await catalog.update_image(conn, self._writer(conn, slug), slug, req)  # type: ignore[arg-type]
        log.info("image_updated", slug=slug)
        return web.json_response(image_dict(row))

    async def delete_image(self, request: web.Request) -> web.Response:
        slug = request.match_info["slug"]
        async with self.pool.acquire() as conn, conn.transaction():
            await catalog.delete_image(conn, self._writer(conn, slug), slug)
        log.info("image_deleted", slug=slug)
        return web.json_response({"deleted": slug})

    async def enable_image(self, request: web.Request) -> web.Response:
        slug = request.match_info["slug"]
        async with self.pool.acquire() as conn, conn.transaction():
            row = await catalog.enable_image(conn, self._writer(conn, slug), slug)
        log.info("image_enabled", slug=slug, status=row["status"])
        return web.json_response(image_dict(row), status=200 if row["status"] == "active" else 202)

    async def disable_image(self, request: web.Request) -> web.Response:
        slug = request.match_info["slug"]
        async with self.pool.acquire() as conn, conn.transaction():
            row = await catalog.disable_image(conn, self._writer(conn, slug), slug)
        log.info("image_disabled", slug=slug)
        return web.json_response(image_dict(row))

    async def prewarm_image(self, request: web.Request) -> web.Response:
        slug = request.match_info["slug"]
        async with self.pool.acquire() as conn, conn.transaction():
            if await catalog.lock_image(conn, slug) is None:
                raise CatalogError(404, "not_found", f"no image {slug}")
            sent = await catalog.prewarm_everywhere(conn, self._writer(conn, slug), slug, cause=f"admin:{uuid.uuid4()}")
        return web.json_response({"slug": slug, "prewarm_tasks": sent}, status=202)

    async def start_build(self, request: web.Request) -> web.Response:
        req = await _body(request, BuildRequest)
        build = await self.runner.start(request.match_info["slug"], req)  # type: ignore[arg-type]
        return web.json_response(build, status=200 if req.dry_run else 202)  # type: ignore[attr-defined]

    async def list_builds(self, request: web.Request) -> web.Response:
        rows = await self.pool.fetch("SELECT * FROM builds WHERE slug = $1 ORDER BY created_at DESC LIMIT 50",
                                     request.match_info["slug"])
        return web.json_response({"builds": [build_dict(r) for r in rows]})

    async def get_build(self, request: web.Request) -> web.Response:
        row = await self.pool.fetchrow("SELECT * FROM builds WHERE build_id = $1", request.match_info["build_id"])
        if row is None:
            raise CatalogError(404, "not_found", "no such build")
        return web.json_response(build_dict(row))

    # --- MAAS host images ---------------------------------------------------------------------------

    def _build_host_tgz(self, slug: str, req: HostUploadRequest) -> HostImage:
        rootfs = Path(req.rootfs)
        if not rootfs.is_dir():
            raise CatalogError(422, "rootfs_missing", f"root tree {req.rootfs} is not a directory")
        bootstrap = Path(req.site_bootstrap) if req.site_bootstrap else None
        if bootstrap is not None and not bootstrap.is_file():
            raise CatalogError(422, "site_bootstrap_missing", f"{req.site_bootstrap} is not a file")
        out_dir = Path(self.settings.host_image_dir)
        # A private temporary name, then the content-addressed one: concurrent builds never share a file
        # and an upload still reading an older tgz keeps its bytes.
        tmp = out_dir / f".{slug}.{uuid.uuid4().hex}.tgz"
        built = build_rootfs_tgz(rootfs, tmp, bootstrap)
        final = out_dir / host_tgz_name(slug, built.sha256)
        os.replace(tmp, final)
        return HostImage(final, built.sha256, built.size)

    async def host_upload(self, request: web.Request) -> web.Response:
        slug = request.match_info["slug"]
        if not SLUG_RE.match(slug):
            raise CatalogError(422, "invalid", f"{slug!r} is not a valid image slug")
        req = await _body(request, HostUploadRequest)
        site = req.site or self.settings.maas_site  # type: ignore[attr-defined]
        # Refuse early what the catalog would refuse anyway, before writing a tgz nobody uploads.
        kind = await self.pool.fetchval("SELECT kind FROM os_images WHERE slug = $1", slug)
        if kind not in (None, "host"):
            raise CatalogError(409, "not_a_host_image", f"{slug} is a {kind} image")
        built = await asyncio.to_thread(self._build_host_tgz, slug, req)  # type: ignore[arg-type]
        async with self.pool.acquire() as conn, conn.transaction():
            row, op_id, sent = await host_images.request_upload(
                conn, self._writer(conn, slug), slug, req, built, site,  # type: ignore[arg-type]
                self.settings.image_cache_dir)
        log.info("host_image_built", slug=slug, sha256=built.sha256, size=built.size, operation_id=op_id,
                 upload_sent=sent)
        return web.json_response({"image": image_dict(row), "operation_id": op_id, "upload_sent": sent,
                                  "sha256": built.sha256, "size": built.size}, status=202 if sent else 200)

    async def maas_profile(self, request: web.Request) -> web.Response:
        slug = request.match_info["slug"]
        req = await _body(request, ProfileImageRequest)
        async with self.pool.acquire() as conn, conn.transaction():
            op_id = await host_images.request_profile_image(
                conn, self._writer(conn, slug), slug, req, self.settings.maas_site)  # type: ignore[arg-type]
            row = await conn.fetchrow("SELECT * FROM maas_requests WHERE operation_id = $1", op_id)
        return web.json_response(host_images.request_dict(row), status=202)

    async def list_maas_requests(self, request: web.Request) -> web.Response:
        rows = await self.pool.fetch("SELECT * FROM maas_requests WHERE slug = $1 ORDER BY created_at DESC LIMIT 50",
                                     request.match_info["slug"])
        return web.json_response({"requests": [host_images.request_dict(r) for r in rows]})

    async def get_maas_request(self, request: web.Request) -> web.Response:
        row = await self.pool.fetchrow("SELECT * FROM maas_requests WHERE operation_id = $1",
                                       request.match_info["operation_id"])
        if row is None:
            raise CatalogError(404, "not_found", "no such MAAS request")
        return web.json_response(host_images.request_dict(row))
