"""A MAAS host image's modes through the image pipeline's admin HTTP API, against a real Postgres: build_only
catalogs a tgz and sends nothing; upload_only sends a tgz built before without reading any tree, and is refused
with its reason (nothing built, file gone, bytes changed) leaving everything as it was; dry_run checks the tree
as a build does and answers what would be done while writing nothing (rows and files counted before and after).
Every upload command in the outbox is validated against the contract. The operator CLI drives the same modes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_image_pipeline.entrypoints.admin_http import AdminApi
from gpuaas_image_pipeline.entrypoints.build_runner import build_runner
from gpuaas_image_pipeline.settings import ImagePipelineSettings

TOKEN = "host-modes-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLUG = "gpuaas-h200-host-ubuntu2404"


@pytest_asyncio.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "image_pipeline", "gpuaas_image_pipeline.migrations")
    await conn.close()
    p = await create_pool(fresh_db, "image_pipeline", min_size=1, max_size=4)
    yield p
    await p.close()


@pytest.fixture
def host_dir(tmp_path: Path) -> Path:
    return tmp_path / "maas-host-images"


@pytest_asyncio.fixture
async def api(pool: asyncpg.Pool, host_dir: Path, tmp_path: Path) -> AsyncIterator[TestClient]:
    settings = ImagePipelineSettings(
        admin_token=SecretStr(TOKEN),
        image_build_dir=str(tmp_path / "builds"),
        image_cache_dir=str(tmp_path / "cache"),
        host_image_dir=str(host_dir),
        host_rootfs_dirs=str(tmp_path),
    )
    client = TestClient(
        TestServer(AdminApi(pool, build_runner(pool, None, settings), settings).app(), host="127.0.0.1")
    )
    await client.start_server()
    yield client
    await client.close()


def make_tree(root: Path, payload: bytes = b"host payload") -> Path:
    """A prepared root tree under <tmp>/trees (the fixture's GPUAAS_HOST_ROOTFS_DIRS is <tmp>)."""
    root = root.parent / "trees" / root.name
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "os-release").write_text('NAME="Ubuntu"\nVERSION_ID="24.04"\n')
    (root / "usr" / "lib" / "gpuaas").mkdir(parents=True)
    (root / "usr" / "lib" / "gpuaas" / "payload").write_bytes(payload)
    return root


async def post(api: TestClient, slug: str, body: dict[str, Any], key: str | None = None) -> tuple[int, Any]:
    headers = {**AUTH, "Idempotency-Key": key or f"k-{body.get('mode')}-{id(body)}-{asyncio.get_running_loop().time()}"}
    resp = await api.post(f"/v1/images/{slug}/host-upload", json=body, headers=headers)
    return resp.status, await resp.json()


async def upload_commands(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    """The outbox's upload commands, each checked against the contract as the relay would publish it."""
    validator = default_validator()
    out = []
    for row in await pool.fetch("SELECT subject, body FROM outbox ORDER BY id"):
        env = validator.validate(row["subject"], bytes(row["body"]))
        if env["type"] == AUDIT:
            continue  # every admin request's audit record, refusals and dry runs included
        assert env["type"] == "maas.image_upload_requested", env
        out.append(env["payload"])
    return out


# The admin API's audit record of each request (issue 27): written for every mode, a dry run's too; the state a
# host-upload could change is everything else.
AUDIT = "image.admin_request_recorded"
AUDIT_SUBJECT = "gpuaas.image.event.admin_request_recorded"


async def state(pool: asyncpg.Pool, host_dir: Path) -> dict[str, Any]:
    """Everything a host-upload could write: catalog rows (whole), MAAS requests, outbox rows, files."""
    rows = await pool.fetch("SELECT slug, kind, status, digest_sha256, metadata::text AS m FROM os_images ORDER BY 1")
    return {
        "images": [tuple(r) for r in rows],
        "maas_requests": await pool.fetchval("SELECT count(*) FROM maas_requests"),
        "outbox": await pool.fetchval("SELECT count(*) FROM outbox WHERE subject <> $1", AUDIT_SUBJECT),
        "files": files(host_dir),
    }


def files(host_dir: Path) -> list[str] | None:
    return sorted(str(p.relative_to(host_dir)) for p in host_dir.rglob("*")) if host_dir.exists() else None


def size_of(path: Path) -> int:
    return path.stat().st_size


async def image(api: TestClient, slug: str = SLUG) -> dict[str, Any]:
    resp = await api.get(f"/v1/images/{slug}", headers=AUTH)
    assert resp.status == 200
    return await resp.json()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- dry_run ----------------------------------------------------------------------------------------


async def test_a_dry_run_checks_the_tree_and_writes_nothing(api, pool, host_dir, tmp_path) -> None:
    tree = make_tree(tmp_path / "rootfs")
    bootstrap = tmp_path / "trees" / "bootstrap.sh"
    bootstrap.write_text("#!/bin/sh\necho site\n")
    before = await state(pool, host_dir)
    audits = await pool.fetchval("SELECT count(*) FROM admin_requests")

    status, body = await post(
        api, SLUG, {"mode": "dry_run", "rootfs": str(tree), "site_bootstrap": str(bootstrap), "site": "lab"}
    )
    assert status == 200, body
    assert (body["mode"], body["image"], body["upload_sent"], body["sha256"], body["operation_id"]) == (
        "dry_run",
        None,
        False,
        None,
        None,
    )
    plan = body["plan"]
    # etc, etc/os-release, usr, usr/lib, usr/lib/gpuaas, the payload; plus the marker and the bootstrap.
    assert plan["tree"] == {
        "rootfs": str(tree),
        "entries": 8,
        "files": 3,
        "file_bytes": len(b"host payload") + (tree / "etc" / "os-release").stat().st_size + bootstrap.stat().st_size,
        "tar_bytes_estimate": plan["tree"]["tar_bytes_estimate"],
        "adds_curtin_marker": True,
        "adds_site_bootstrap": True,
        "skipped": [],
    }
    assert plan["tree"]["tar_bytes_estimate"] > plan["tree"]["file_bytes"]
    assert plan["tgz_dir"] == str(host_dir) and plan["tgz_name"].startswith(f"{SLUG}-")
    assert plan["creates_image"] is True
    assert plan["upload"] == {
        "site": "lab",
        "name": f"custom/{SLUG}",
        "title": "",
        "architecture": "amd64/generic",
        "base_image": "ubuntu/noble",
        "filetype": "tgz",
    }
    assert any("curtin" in s for s in plan["steps"]) and any("site lab" in s for s in plan["steps"])

    # Nothing at all was written: no file (not even the directory), no catalog row, no MAAS request, no outbox
    # row; the admin stack's audit row is the one trace, as for every mutation.
    assert await state(pool, host_dir) == before == {"images": [], "maas_requests": 0, "outbox": 0, "files": None}
    assert await pool.fetchval("SELECT count(*) FROM admin_requests") == audits + 1

    # A tree the build would refuse is refused the same way by the dry run, still writing nothing.
    (tree / "etc" / "os-release").unlink()
    status, body = await post(api, SLUG, {"mode": "dry_run", "rootfs": str(tree)})
    assert (status, body["error"]["code"]) == (422, "rootfs_not_an_os_tree"), body
    status, body = await post(api, SLUG, {"mode": "dry_run", "rootfs": str(tmp_path / "trees" / "nope")})
    assert (status, body["error"]["code"]) == (422, "rootfs_missing"), body
    assert await state(pool, host_dir) == before


async def test_a_dry_run_of_a_catalogued_image_leaves_it_as_it_was(api, pool, host_dir, tmp_path) -> None:
    tree = make_tree(tmp_path / "rootfs")
    status, built = await post(api, SLUG, {"mode": "build_only", "rootfs": str(tree)})
    assert status == 200, built
    before = await state(pool, host_dir)
    status, body = await post(api, SLUG, {"mode": "dry_run", "rootfs": str(make_tree(tmp_path / "other", b"x"))})
    assert status == 200, body
    assert body["plan"]["creates_image"] is False and body["image"]["slug"] == SLUG
    assert await state(pool, host_dir) == before


# --- build_only -------------------------------------------------------------------------------------


async def test_build_only_catalogs_the_tgz_and_sends_no_upload(api, pool, host_dir, tmp_path) -> None:
    tree = make_tree(tmp_path / "rootfs")
    status, body = await post(api, SLUG, {"mode": "build_only", "rootfs": str(tree)})
    assert status == 200, body
    assert (body["mode"], body["upload_sent"], body["operation_id"], body["plan"]) == ("build_only", False, None, None)
    tgz = Path(body["source_path"])
    assert tgz.parent == host_dir and (body["sha256"], body["size"]) == (sha256_of(tgz), size_of(tgz))
    assert files(host_dir) == [tgz.name]  # no temporary file left

    # Catalogued, visibly built and not uploaded: a disabled host image, no digest MAAS holds, no maas record.
    row = await image(api)
    assert (row["kind"], row["status"], row["digest_sha256"]) == ("host", "disabled", None)
    assert "maas" not in row["metadata"]
    [build] = row["metadata"]["host_builds"]
    assert {k: build[k] for k in ("sha256", "size", "source_path", "status", "operation_id")} == {
        "sha256": body["sha256"],
        "size": body["size"],
        "source_path": str(tgz),
        "status": "built",
        "operation_id": None,
    }
    assert await upload_commands(pool) == []
    assert await pool.fetchval("SELECT count(*) FROM maas_requests") == 0


async def test_build_only_leaves_what_maas_holds_and_deploys_alone(api, pool, host_dir, tmp_path) -> None:
    status, first = await post(api, SLUG, {"rootfs": str(make_tree(tmp_path / "v1", b"v1"))})
    assert (status, first["mode"], first["upload_sent"]) == (202, "build_and_upload", True), first
    status, second = await post(api, SLUG, {"mode": "build_only", "rootfs": str(make_tree(tmp_path / "v2", b"v2"))})
    assert status == 200 and second["sha256"] != first["sha256"], second
    row = await image(api)
    # The upload under way is still the one described; the new tgz waits, built.
    assert (row["status"], row["digest_sha256"]) == ("building", first["sha256"])
    assert (row["metadata"]["maas"]["sha256"], row["metadata"]["maas"]["operation_id"]) == (
        first["sha256"],
        first["operation_id"],
    )
    assert [(b["sha256"], b["status"]) for b in row["metadata"]["host_builds"]] == [
        (second["sha256"], "built"),
        (first["sha256"], "upload_requested"),
    ]
    assert [c["sha256"] for c in await upload_commands(pool)] == [first["sha256"]]


# --- upload_only ------------------------------------------------------------------------------------


async def test_upload_only_sends_the_built_tgz_without_reading_a_tree(api, pool, host_dir, tmp_path) -> None:
    tree = make_tree(tmp_path / "rootfs")
    status, built = await post(api, SLUG, {"mode": "build_only", "rootfs": str(tree)})
    assert status == 200, built
    shutil.rmtree(tree)  # the upload reads no tree

    status, sent = await post(api, SLUG, {"mode": "upload_only", "title": "GPUaaS H200 Host", "site": "lab"})
    assert status == 202, sent
    assert (sent["mode"], sent["upload_sent"], sent["sha256"], sent["size"], sent["source_path"]) == (
        "upload_only",
        True,
        built["sha256"],
        built["size"],
        built["source_path"],
    )
    [cmd] = await upload_commands(pool)
    assert cmd == {
        "operation_id": sent["operation_id"],
        "site": "lab",
        "name": SLUG,
        "title": "GPUaaS H200 Host",
        "architecture": "amd64/generic",
        "filetype": "tgz",
        "base_image": "ubuntu/noble",
        "source_path": built["source_path"],
        "sha256": built["sha256"],
        "size": built["size"],
    }
    row = await image(api)
    assert (row["status"], row["digest_sha256"], row["metadata"]["maas"]["status"]) == (
        "building",
        built["sha256"],
        "uploading",
    )
    assert [(b["status"], b["operation_id"]) for b in row["metadata"]["host_builds"]] == [
        ("upload_requested", sent["operation_id"])
    ]
    # The same bytes already on their way to that site: nothing is sent twice.
    status, again = await post(api, SLUG, {"mode": "upload_only", "site": "lab"})
    assert (status, again["upload_sent"], again["operation_id"]) == (200, False, sent["operation_id"]), again
    assert len(await upload_commands(pool)) == 1


async def test_upload_only_sends_the_build_its_sha256_names(api, pool, host_dir, tmp_path) -> None:
    _, older = await post(api, SLUG, {"mode": "build_only", "rootfs": str(make_tree(tmp_path / "a", b"a"))})
    _, newer = await post(api, SLUG, {"mode": "build_only", "rootfs": str(make_tree(tmp_path / "b", b"b"))})
    status, sent = await post(api, SLUG, {"mode": "upload_only", "sha256": older["sha256"]})
    assert (status, sent["sha256"]) == (202, older["sha256"]), sent
    assert [c["sha256"] for c in await upload_commands(pool)] == [older["sha256"]]
    row = await image(api)
    assert {b["sha256"]: b["status"] for b in row["metadata"]["host_builds"]} == {
        newer["sha256"]: "built",
        older["sha256"]: "upload_requested",
    }


async def test_upload_only_refusals_leave_everything_as_it_was(api, pool, host_dir, tmp_path) -> None:
    # No such image, and a slice image: nothing to reuse.
    status, body = await post(api, "nowhere-host", {"mode": "upload_only"})
    assert (status, body["error"]["code"]) == (404, "not_found"), body
    resp = await api.post(
        "/v1/images", json={"slug": "a-slice", "kind": "slice"}, headers={**AUTH, "Idempotency-Key": "mk-slice"}
    )
    assert resp.status == 201
    status, body = await post(api, "a-slice", {"mode": "upload_only"})
    assert (status, body["error"]["code"]) == (409, "not_a_host_image"), body
    # A host image that was never built.
    resp = await api.post(
        "/v1/images", json={"slug": SLUG, "kind": "host"}, headers={**AUTH, "Idempotency-Key": "mk-host"}
    )
    assert resp.status == 201
    before = await state(pool, host_dir)
    status, body = await post(api, SLUG, {"mode": "upload_only"})
    assert (status, body["error"]["code"]) == (409, "not_built"), body
    assert await state(pool, host_dir) == before

    status, built = await post(api, SLUG, {"mode": "build_only", "rootfs": str(make_tree(tmp_path / "rootfs"))})
    assert status == 200, built
    tgz = Path(built["source_path"])
    before = await state(pool, host_dir)
    # A sha256 that names no build of this image.
    status, body = await post(api, SLUG, {"mode": "upload_only", "sha256": "f" * 64})
    assert (status, body["error"]["code"]) == (409, "not_built"), body
    assert body["error"]["details"]["built"] == [built["sha256"]]
    # Its bytes changed since the build (same size, then another size).
    original = await asyncio.to_thread(tgz.read_bytes)
    await asyncio.to_thread(tgz.write_bytes, bytes(b ^ 0xFF for b in original))
    status, body = await post(api, SLUG, {"mode": "upload_only"})
    assert (status, body["error"]["code"]) == (409, "built_tgz_changed"), body
    assert body["error"]["details"]["sha256"] == built["sha256"]
    await asyncio.to_thread(tgz.write_bytes, original + b"\0")
    status, body = await post(api, SLUG, {"mode": "upload_only"})
    assert (status, body["error"]["code"]) == (409, "built_tgz_changed"), body
    # Its file is gone; the refusal stores no answer, so the same key goes through once the tgz is back.
    await asyncio.to_thread(tgz.unlink)
    status, body = await post(api, SLUG, {"mode": "upload_only"}, key="upload-after-rebuild")
    assert (status, body["error"]["code"]) == (409, "built_tgz_missing"), body
    after = await state(pool, host_dir)
    assert after == {**before, "files": []}  # only the file the test removed differs
    assert await upload_commands(pool) == []

    status, rebuilt = await post(api, SLUG, {"mode": "build_only", "rootfs": str(tmp_path / "trees" / "rootfs")})
    assert (status, rebuilt["sha256"], rebuilt["source_path"]) == (200, built["sha256"], str(tgz)), rebuilt
    status, sent = await post(api, SLUG, {"mode": "upload_only"}, key="upload-after-rebuild")
    assert (status, sent["sha256"]) == (202, built["sha256"]), sent
    assert [c["sha256"] for c in await upload_commands(pool)] == [built["sha256"]]


async def test_a_request_that_does_not_fit_its_mode_is_refused_before_anything(api, pool, host_dir, tmp_path) -> None:
    tree = make_tree(tmp_path / "rootfs")
    for body in (
        {"mode": "upload_only", "rootfs": str(tree)},
        {"mode": "build_only"},
        {"mode": "build_only", "rootfs": str(tree), "sha256": "a" * 64},
        {"mode": "rebuild", "rootfs": str(tree)},
    ):
        status, answer = await post(api, SLUG, body)
        assert (status, answer["error"]["code"]) == (422, "invalid_request"), (body, answer)
    # A tree whose output directory lies inside it would archive itself: refused, nothing written.
    status, answer = await post(api, SLUG, {"mode": "build_only", "rootfs": str(host_dir.parent)})
    assert (status, answer["error"]["code"]) == (422, "rootfs_holds_output"), answer
    assert await state(pool, host_dir) == {"images": [], "maas_requests": 0, "outbox": 0, "files": None}


# --- the operator CLI ---------------------------------------------------------------------------------


BIN = Path(sys.executable).parent


async def gpuaas(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The installed `gpuaas`, in a process of its own (its answer alone on stdout), no stack selected."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUAAS_IMAGE_ADMIN", "GPUAAS_ADMIN"))}
    return await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "gpuaas"), *argv, "--run-dir", str(tmp_path / "no-stack")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


async def test_the_cli_drives_each_mode_with_an_idempotency_key(api, pool, host_dir, tmp_path) -> None:
    tree = make_tree(tmp_path / "rootfs")
    api_opts = ["--admin-url", str(api.make_url("")).rstrip("/"), "--token", TOKEN]

    async def host_upload(*argv: str) -> subprocess.CompletedProcess[str]:
        return await gpuaas(tmp_path, "images", "host-upload", *argv, *api_opts)

    res = await host_upload(SLUG, "--rootfs", str(tree), "--mode", "dry-run", "-o", "json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["plan"]["tree"]["files"] == 2
    assert await state(pool, host_dir) == {"images": [], "maas_requests": 0, "outbox": 0, "files": None}
    res = await host_upload(SLUG, "--rootfs", str(tree), "--mode", "dry-run")
    assert res.returncode == 0 and "would: add the curtin marker directory /curtin" in res.stdout, res.stdout

    build = (SLUG, "--rootfs", str(tree), "--mode", "build-only", "--idempotency-key", "cli-b1", "-o", "json")
    res = await host_upload(*build)
    assert res.returncode == 0, res.stderr
    built = json.loads(res.stdout)
    assert (built["mode"], built["upload_sent"]) == ("build_only", False)
    # The same key again replays the stored answer: one build, one catalog entry.
    res = await host_upload(*build)
    assert res.returncode == 0 and json.loads(res.stdout) == built, res.stderr
    assert len((await image(api))["metadata"]["host_builds"]) == 1

    res = await host_upload(SLUG, "--mode", "upload-only", "--sha256", built["sha256"], "--site", "lab")
    assert res.returncode == 0, res.stderr
    assert re.search(r"^upload sent +yes$", res.stdout, re.M), res.stdout
    assert [(c["sha256"], c["site"]) for c in await upload_commands(pool)] == [(built["sha256"], "lab")]

    # Refusals: one line with the reason; a tree or request the API finds invalid is a usage error (exit 2).
    res = await host_upload("other-host", "--mode", "upload-only")
    assert (res.returncode, res.stderr.strip()) == (1, "no image other-host"), res.stderr
    await asyncio.to_thread(tree.joinpath("etc", "os-release").unlink)
    res = await host_upload(SLUG, "--rootfs", str(tree), "--mode", "build-only")
    assert res.returncode == 2 and "has no etc/os-release: not a root filesystem" in res.stderr, res.stderr
    res = await host_upload(SLUG, "--mode", "upload-only", "--rootfs", str(tree))
    assert res.returncode == 2 and "invalid request" in res.stderr and "reads no tree" in res.stderr, res.stderr


async def test_a_tree_or_bootstrap_outside_the_allowed_directories_is_refused(api, pool, host_dir, tmp_path) -> None:
    """N15: rootfs and site_bootstrap name paths of the pipeline's host; only the configured directories may be
    archived, links resolved first. `/` (which has an etc/os-release) and a link to it inside the allowed
    directory are refused in one line, writing nothing."""
    before = await state(pool, host_dir)
    tree = make_tree(tmp_path / "rootfs")
    (tmp_path / "trees" / "to-host").symlink_to("/")
    for rootfs in ("/", str(tmp_path / "trees" / "to-host"), str(tmp_path / ".." / "..")):
        status, body = await post(api, SLUG, {"mode": "build_only", "rootfs": rootfs})
        assert (status, body["error"]["code"]) == (422, "path_refused"), (rootfs, body)
        assert "is outside the directories allowed for it" in body["error"]["message"], body
    status, body = await post(api, SLUG, {"mode": "dry_run", "rootfs": str(tree), "site_bootstrap": "/etc/shadow"})
    assert (status, body["error"]["code"]) == (422, "path_refused"), body
    assert await state(pool, host_dir) == before
