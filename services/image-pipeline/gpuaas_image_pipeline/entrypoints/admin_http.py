"""Admin HTTP API of the image catalog, on the shared stack (`gpuaas_common.admin_http`: bearer auth, one
error shape, Idempotency-Key and an audit row per mutation, all in one unit of work).

`services/image-pipeline/openapi.yaml` is rendered from `routes()`:
`python -m gpuaas_image_pipeline.entrypoints.admin_http services/image-pipeline/openapi.yaml`.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from gpuaas_common import admin_http
from gpuaas_common.admin_http import Call, Reply, Route, openapi, render_yaml
from gpuaas_common.logging import get_logger

from ..adapters import paths
from ..adapters.host_image import (
    SITE_BOOTSTRAP,
    HostImage,
    HostTreeError,
    TreePlan,
    build_rootfs_tgz,
    check_out_dir,
    plan_rootfs,
    verify_built_tgz,
)
from ..adapters.repository import ImagePipelineRepositories, image_pipeline_repositories
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
from . import api_models as out

log = get_logger(__name__)
SCHEMA = "image_pipeline"
# The catalog's slug rule, checked before a slug becomes part of a file name.
SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


class AdminApi:
    """The catalog's handlers; `api()` puts them behind the shared stack."""

    def __init__(self, pool: asyncpg.Pool, runner: BuildRunner, settings: ImagePipelineSettings) -> None:
        self.pool = pool
        self.runner = runner
        self.settings = settings
        self._api: admin_http.AdminApi | None = None

    @property
    def port(self) -> int | None:
        return self._api.port if self._api is not None else None

    def api(self) -> admin_http.AdminApi:
        return admin_http.AdminApi(
            service="image-pipeline",
            schema=SCHEMA,
            pool=self.pool,
            tokens={"admin": self.settings.admin_token},
            routes=self.routes(),
            repositories=image_pipeline_repositories,
            document=openapi_document,
            # Every mutation's audit record also goes to the bus, for ops (ops-view's audit model).
            audit_event="image.admin_request_recorded",
        )

    def app(self):
        return self.api().app()

    async def start(self) -> int:
        self._api = self.api()  # refuses without a token
        return await self._api.start(self.settings.admin_host, self.settings.admin_port)

    async def stop(self) -> None:
        if self._api is not None:
            await self._api.stop()

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/images", self.list_images, "list the catalog", out.ImageList),
            Route(
                "POST",
                "/v1/images",
                self.create_image,
                "add a catalog row (disabled until built and enabled)",
                out.ImageView,
                ImageCreate,
                statuses=(201,),
                errors=(409,),
            ),
            Route(
                "GET", "/v1/images/{slug}", self.get_image, "an image, its node caches and last build", out.ImageDetail
            ),
            Route(
                "PATCH",
                "/v1/images/{slug}",
                self.update_image,
                "change SKU, driver strategy or metadata",
                out.ImageView,
                ImageUpdate,
            ),
            Route("DELETE", "/v1/images/{slug}", self.delete_image, "remove an image (deactivates it)", out.Deleted),
            Route(
                "POST",
                "/v1/images/{slug}/enable",
                self.enable_image,
                "activate (200) or publish and prewarm until every host verified it (202)",
                out.ImageView,
                statuses=(200, 202),
                errors=(409,),
            ),
            Route("POST", "/v1/images/{slug}/disable", self.disable_image, "deactivate an image", out.ImageView),
            Route(
                "POST",
                "/v1/images/{slug}/prewarm",
                self.prewarm_image,
                "send prewarm tasks to every host",
                out.Prewarm,
                statuses=(202,),
            ),
            Route(
                "POST",
                "/v1/images/{slug}/builds",
                self.start_build,
                "build, push and catalog a slice image (202), or plan it (dry_run: 200)",
                out.BuildView,
                BuildRequest,
                statuses=(202, 200),
                errors=(409,),
                body_required=False,
            ),
            Route("GET", "/v1/images/{slug}/builds", self.list_builds, "an image's last 50 builds", out.BuildList),
            Route("GET", "/v1/builds/{build_id}", self.get_build, "one build", out.BuildView),
            Route(
                "POST",
                "/v1/images/{slug}/host-upload",
                self.host_upload,
                "archive a root tree as a MAAS host image and ask the gateway to upload it (mode "
                "build_and_upload: 202; 200 when the same content is already there), only build and catalog it "
                "(build_only: 200), send a tgz built before (upload_only: 202/200; 409 when none is built or its "
                "file is gone or changed) or check it all and say what would be done (dry_run: 200, writes nothing)",
                out.HostUpload,
                HostUploadRequest,
                statuses=(202, 200),
                errors=(409,),
            ),
            Route(
                "POST",
                "/v1/images/{slug}/maas-profile",
                self.maas_profile,
                "point a MAAS site profile at this host image",
                out.MaasRequestView,
                ProfileImageRequest,
                statuses=(202,),
                errors=(409,),
            ),
            Route(
                "GET",
                "/v1/images/{slug}/maas-requests",
                self.list_maas_requests,
                "what was asked of MAAS for this image",
                out.MaasRequestList,
            ),
            Route(
                "GET",
                "/v1/maas-requests/{operation_id}",
                self.get_maas_request,
                "one MAAS request",
                out.MaasRequestView,
            ),
        ]

    # --- handlers -------------------------------------------------------------------------------

    @staticmethod
    def _repos(call: Call) -> ImagePipelineRepositories:
        """A mutation's unit of work holds them already; a read builds them on its plain connection."""
        return call.uow.repos if call.uow is not None else image_pipeline_repositories(call.conn)

    async def list_images(self, call: Call) -> dict:
        return {"images": [image_dict(r) for r in await self._repos(call).images.all_by_slug()]}

    async def get_image(self, call: Call) -> dict:
        repos, slug = self._repos(call), call.params["slug"]
        row = await repos.images.get(slug)
        if row is None:
            raise CatalogError(404, "not_found", f"no image {slug}")
        out = image_dict(row)
        out["nodes"] = await catalog.node_caches(repos, slug)
        last = await repos.builds.of_image(slug, 1)
        out["last_build"] = build_dict(last[0]) if last else None
        return out

    async def create_image(self, call: Call) -> dict:
        row = await catalog.create_image(call.uow, call.body, self.settings.image_cache_dir)  # type: ignore[arg-type]
        log.info("image_created", slug=row["slug"])
        return image_dict(row)

    async def update_image(self, call: Call) -> dict:
        slug = call.params["slug"]
        row = await catalog.update_image(call.uow, slug, call.body)  # type: ignore[arg-type]
        log.info("image_updated", slug=slug)
        return image_dict(row)

    async def delete_image(self, call: Call) -> dict:
        slug = call.params["slug"]
        await catalog.delete_image(call.uow, slug)  # type: ignore[arg-type]
        log.info("image_deleted", slug=slug)
        return {"deleted": slug}

    async def enable_image(self, call: Call) -> Reply:
        slug = call.params["slug"]
        row = await catalog.enable_image(call.uow, slug)  # type: ignore[arg-type]
        log.info("image_enabled", slug=slug, status=row["status"])
        return Reply(image_dict(row), 200 if row["status"] == "active" else 202)

    async def disable_image(self, call: Call) -> dict:
        slug = call.params["slug"]
        row = await catalog.disable_image(call.uow, slug)  # type: ignore[arg-type]
        log.info("image_disabled", slug=slug)
        return image_dict(row)

    async def prewarm_image(self, call: Call) -> dict:
        slug = call.params["slug"]
        if await self._repos(call).images.lock(slug) is None:
            raise CatalogError(404, "not_found", f"no image {slug}")
        sent = await catalog.prewarm_everywhere(call.uow, slug, cause=f"admin:{uuid.uuid4()}")  # type: ignore[arg-type]
        return {"slug": slug, "prewarm_tasks": sent}

    async def start_build(self, call: Call) -> Reply:
        req: BuildRequest = call.body
        build, launch = await self.runner.begin(call.uow, call.params["slug"], req)  # type: ignore[arg-type]
        if launch is not None:
            call.after_commit.append(launch)
        return Reply(build, 200 if req.dry_run else 202)

    async def list_builds(self, call: Call) -> dict:
        rows = await self._repos(call).builds.of_image(call.params["slug"], 50)
        return {"builds": [build_dict(r) for r in rows]}

    async def get_build(self, call: Call) -> dict:
        row = await self._repos(call).builds.get(call.params["build_id"])
        if row is None:
            raise CatalogError(404, "not_found", "no such build")
        return build_dict(row)

    # --- MAAS host images ---------------------------------------------------------------------------

    def _tree_plan(self, req: HostUploadRequest) -> tuple[TreePlan, int]:
        """The build's checks of the request's tree and of where it writes, without writing: what a dry run
        answers and a build passes first. Returns the plan and the free bytes there; a refusal is a 4xx with
        its reason code."""
        rootfs, bootstrap = self._tree_inputs(req)
        out_dir = Path(self.settings.host_image_dir)
        try:
            plan = plan_rootfs(rootfs, out_dir, bootstrap)
            free = check_out_dir(out_dir)
        except HostTreeError as exc:
            status = 409 if exc.code == "host_image_dir_unwritable" else 422
            raise CatalogError(status, exc.code, exc.message) from None
        return plan, free

    def _tree_inputs(self, req: HostUploadRequest) -> tuple[Path, Path | None]:
        """rootfs and site_bootstrap with their links resolved, inside GPUAAS_HOST_ROOTFS_DIRS (N15): a request
        must not archive the pipeline host's own files into an image MAAS deploys."""
        assert req.rootfs is not None  # the request model requires it for every mode that reads a tree
        dirs = paths.dirs_setting(self.settings.host_rootfs_dirs)
        try:
            rootfs = paths.confined(req.rootfs, dirs, what="rootfs", code="path_refused")
            bootstrap = (
                paths.confined(req.site_bootstrap, dirs, what="site_bootstrap", code="path_refused")
                if req.site_bootstrap
                else None
            )
        except paths.PathRefused as exc:
            raise CatalogError(422, "path_refused", str(exc)) from None
        return rootfs, bootstrap

    def _build_host_tgz(self, slug: str, req: HostUploadRequest) -> HostImage:
        self._tree_plan(req)
        rootfs, bootstrap = self._tree_inputs(req)
        out_dir = Path(self.settings.host_image_dir)
        # A private temporary name, then the content-addressed one: concurrent builds never share a file
        # and an upload still reading an older tgz keeps its bytes.
        tmp = out_dir / f".{slug}.{uuid.uuid4().hex}.tgz"
        try:
            built = build_rootfs_tgz(rootfs, tmp, bootstrap)
            final = out_dir / host_tgz_name(slug, built.sha256)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return HostImage(final, built.sha256, built.size)

    def _dry_run_plan(self, slug: str, req: HostUploadRequest, site: str, row: Any) -> dict[str, Any]:
        """What build_and_upload would do with this request, from the same checks; nothing is written."""
        plan, free = self._tree_plan(req)
        out_dir = Path(self.settings.host_image_dir)
        name = host_tgz_name(slug, "<sha256[:16]>")  # named by its content, known once archived
        target = {
            "site": site,
            "name": f"custom/{slug}",
            "title": req.title,
            "architecture": req.architecture,
            "base_image": req.base_image,
            "filetype": "tgz",
        }
        steps = [
            f"archive {plan.entries} entries of {req.rootfs} ({plan.files} files, {plan.file_bytes} B; "
            f"tar about {plan.tar_bytes} B before gzip)",
        ]
        if plan.adds_curtin_marker:
            steps.append("add the curtin marker directory /curtin")
        if plan.adds_site_bootstrap:
            steps.append(f"add {req.site_bootstrap} as /{SITE_BOOTSTRAP} (0755)")
        steps += [
            f"write {out_dir / name} (named by its sha256)",
            f"{'create host image ' + slug + ' (disabled) and ' if row is None else ''}"
            f"record the tgz under {slug}'s host_builds",
            f"ask the MAAS gateway to upload it to site {site} as custom/{slug} (unless that site already holds "
            "the same bytes)",
        ]
        return {
            "tree": plan.as_dict(),
            "tgz_dir": str(out_dir),
            "tgz_name": name,
            "free_bytes": free,
            "creates_image": row is None,
            "upload": target,
            "steps": steps,
        }

    async def host_upload(self, call: Call) -> Reply:
        slug = call.params["slug"]
        if not SLUG_RE.match(slug):
            raise CatalogError(422, "invalid", f"{slug!r} is not a valid image slug")
        req: HostUploadRequest = call.body
        site = req.site or self.settings.maas_site
        repos = self._repos(call)
        # Refuse early what the catalog would refuse anyway, before writing a tgz nobody uploads.
        kind = await repos.images.kind(slug)
        if kind not in (None, "host"):
            raise CatalogError(409, "not_a_host_image", f"{slug} is a {kind} image")
        answer: dict[str, Any] = {
            "mode": req.mode,
            "operation_id": None,
            "upload_sent": False,
            "sha256": None,
            "size": None,
            "source_path": None,
            "plan": None,
        }
        if req.mode == "dry_run":
            # Reads only: no file, no catalog row, no outbox row (the admin stack still audits the request).
            row = await repos.images.get(slug)
            answer["plan"] = await asyncio.to_thread(self._dry_run_plan, slug, req, site, row)
            answer["image"] = image_dict(row) if row is not None else None
            log.info("host_image_dry_run", slug=slug, entries=answer["plan"]["tree"]["entries"])
            return Reply(answer, 200)
        uow = call.uow
        assert uow is not None
        if req.mode == "upload_only":
            built = await host_images.built_tgz(uow, slug, req)  # type: ignore[arg-type]
            # Re-read, not trusted: the file must still hold the bytes catalogued before MAAS is asked for them.
            why = await asyncio.to_thread(verify_built_tgz, built.path, built.sha256, built.size)
            if why is not None:
                raise CatalogError(
                    409,
                    why,
                    f"the built tgz {built.path} of {slug} cannot be sent: "
                    + {
                        "built_tgz_missing": "the file is gone",
                        "built_tgz_changed": "its bytes no longer match the recorded sha256 and size",
                        "built_tgz_unreadable": "it cannot be read",
                    }[why]
                    + "; build it again",
                    {"sha256": built.sha256, "size": built.size, "source_path": str(built.path)},
                )
            row = None
        else:
            # Built inside the open unit of work: the stored answer of a retried request must name this file.
            built = await asyncio.to_thread(self._build_host_tgz, slug, req)
            row = await host_images.record_build(uow, slug, req, built, self.settings.image_cache_dir)  # type: ignore[arg-type]
        op_id, sent = None, False
        if req.uploads:
            row, op_id, sent = await host_images.request_upload(
                uow,  # type: ignore[arg-type]
                slug,
                req,
                built,
                site,
                self.settings.image_cache_dir,
            )
        log.info(
            "host_image_built" if req.builds else "host_image_reused",
            slug=slug,
            mode=req.mode,
            sha256=built.sha256,
            size=built.size,
            operation_id=op_id,
            upload_sent=sent,
        )
        answer.update(
            image=image_dict(row),  # type: ignore[arg-type]
            operation_id=op_id,
            upload_sent=sent,
            sha256=built.sha256,
            size=built.size,
            source_path=str(built.path),
        )
        return Reply(answer, 202 if sent else 200)

    async def maas_profile(self, call: Call) -> dict:
        slug = call.params["slug"]
        op_id = await host_images.request_profile_image(call.uow, slug, call.body, self.settings.maas_site)  # type: ignore[arg-type]
        row = await self._repos(call).maas_requests.get(op_id)
        return host_images.request_dict(row)  # type: ignore[arg-type]

    async def list_maas_requests(self, call: Call) -> dict:
        rows = await self._repos(call).maas_requests.of_image(call.params["slug"], 50)
        return {"requests": [host_images.request_dict(r) for r in rows]}

    async def get_maas_request(self, call: Call) -> dict:
        row = await self._repos(call).maas_requests.get(call.params["operation_id"])
        if row is None:
            raise CatalogError(404, "not_found", "no such MAAS request")
        return host_images.request_dict(row)


def openapi_document() -> dict[str, Any]:
    routes = AdminApi(None, None, ImagePipelineSettings.model_construct()).routes()  # type: ignore[arg-type]
    return openapi(
        routes,
        title="gpuaas image pipeline admin API",
        version="1",
        description="The image catalog: images (create, update, enable, disable, delete), slice image builds "
        "and prewarm, MAAS host images and site profiles. Every mutation needs an Idempotency-Key "
        "and is audited (admin_requests); errors share one shape.",
    )


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(render_yaml(openapi_document()))
