"""Image pipeline end to end: build with qemu-img, publish to a real registry, prewarm and verify on
every slice host through the bus, activate, allocate on the image; a node whose pulled bytes are
corrupted in transit reports a mismatch and keeps the image inactive."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gpuaas_common.bus import Bus, HandlerContext, parse_message
from gpuaas_common.contract import messages as m
from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.waiting import eventually
from gpuaas_node_agent.adapters.state_store import StateStore
from gpuaas_node_agent.service_layer.host_paths import HostPaths
from gpuaas_node_agent.service_layer.prewarm import ImagePrewarmer

pytestmark = pytest.mark.e2e

SLUG = "ubuntu-24.04-h200-cuda"
NEXT = "ubuntu-24.04-h200-cuda-next"
LATE = "late-slice-host"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_source(path: Path, marker: int) -> Path:
    """A small real qcow2: 64 MiB virtual, a few MiB of data, an MBR signature."""
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "64M"], check=True)
    for cmd in (
        f"write -q -P {marker} 0 2M",
        "write -q -P 0x55 510 1",
        "write -q -P 0xaa 511 1",
        "write -q -P 0xcd 40M 1M",
    ):
        subprocess.run(["qemu-io", "-f", "qcow2", "-c", cmd, str(path)], check=True)
    return path


async def admin(stack: Stack, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token if token is not None else stack.image_admin_token}"}
    if method != "GET":
        headers["Idempotency-Key"] = uuid.uuid4().hex
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"{stack.image_admin_url}{path}", json=body, headers=headers) as resp:
            return resp.status, await resp.json()


async def wait_build(stack: Stack, build_id: str) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        _, build = await admin(stack, "GET", f"/v1/builds/{build_id}")
        assert build["status"] != "failed", build["error"]
        return build if build["status"] == "published" else None

    return await eventually(done, timeout=120, interval=0.2, what=f"build {build_id} published")


async def allocator_offers(db, slug: str, digest: str | None) -> None:
    """Wait until the allocator has applied the newest image event: seen on the bus is not yet applied by its own
    consumer, and a request racing it is judged by the image the allocator still knew (CI lost that race on a
    loaded machine). `digest` None: the slug is no longer offered."""
    await eventually(
        lambda: db.fetchval(
            "SELECT digest_sha256 IS NOT DISTINCT FROM $2 FROM (SELECT 1) one "
            "LEFT JOIN allocator.active_images ON slug = $1",
            slug,
            digest,
        ),
        what=f"the allocator offers {slug} at {digest}",
    )


async def cache_rows(db, slug: str) -> dict[str, dict[str, Any]]:
    rows = await db.fetch("SELECT * FROM image_pipeline.node_image_cache WHERE slug = $1", slug)
    return {r["node_id"]: dict(r) for r in rows}


@pytest.fixture(scope="module")
async def known_hosts(stack: Stack, db) -> list[str]:
    hosts = sorted(n.node_id for n in stack.fleet.nodes if n.kind == "slice_host")
    await eventually(lambda: _count_hosts(db, len(hosts)), timeout=60, what="pipeline knows the slice hosts")
    return hosts


async def _count_hosts(db, n: int) -> bool:
    return await db.fetchval("SELECT count(*) FROM image_pipeline.slice_hosts") >= n


async def test_build_publish_prewarm_activate_allocate(stack: Stack, portal, db, known_hosts, tmp_path: Path) -> None:
    source = make_source(tmp_path / "noble.qcow2", 0xAB)
    status, build = await admin(
        stack,
        "POST",
        f"/v1/images/{SLUG}/builds",
        {"source": str(source), "packages": ["cuda-drivers-570", "rdma-core"]},
    )
    assert status == 202, build
    build = await wait_build(stack, build["build_id"])
    activated = await portal.spy.wait_type("image.activated", timeout=120, slug=SLUG)

    # The digest is the sha256 of the converted raw, checked here independently of the pipeline.
    raw = Path(build["raw_path"])
    digest = sha256(raw)
    assert build["raw_sha256"] == digest == activated["payload"]["digest_sha256"]
    out = await asyncio.to_thread(
        subprocess.run, ["qemu-img", "info", "--output=json", str(raw)], check=True, capture_output=True, text=True
    )
    assert json.loads(out.stdout)["format"] == "raw"

    def read_stamp() -> dict:  # the customisation step really edited the image
        with raw.open("rb") as f:
            f.seek(1 << 20)
            return json.loads(f.read(4096).rstrip(b"\0"))

    stamp = await asyncio.to_thread(read_stamp)
    assert stamp["build_id"] == build["build_id"] and stamp["packages"] == ["cuda-drivers-570", "rdma-core"]
    # Holes did not travel: the artifact is about the size of the data, not of the disk.
    assert build["blob_size"] < build["virtual_size"] // 4

    _, image = await admin(stack, "GET", f"/v1/images/{SLUG}")
    assert image["status"] == "active" and image["digest_sha256"] == digest
    assert image["source_uri"].startswith(f"oci://{stack.registry_host}/slice-guest-images/{SLUG}:")
    assert image["metadata"]["artifact_ref"] == image["source_uri"]
    image_path = image["metadata"]["image_path"]
    assert {n["node_id"]: (n["status"], n["schedulable"]) for n in image["nodes"]} == {
        h: ("verified", True) for h in known_hosts
    }
    for node in stack.fleet.nodes:
        if node.kind == "slice_host":
            assert sha256(HostPaths(Path(node.host_root)).host(image_path)) == digest
    assert portal.spy.of_type("image.published", slug=SLUG)
    for h in known_hosts:
        assert portal.spy.of_type("node.image_cache_reported", node_id=h, slug=SLUG, status="verified")

    await allocator_offers(db, SLUG, digest)
    alloc = await portal.request("gpu_slice", gpus=1, image=SLUG)
    await portal.wait_state(alloc, "active", timeout=90)
    task = portal.spy.of_type("slice.vm_provision", allocation_id=alloc)[0]["payload"]
    assert task["image"] == {
        "slug": SLUG,
        "digest_sha256": digest,
        "image_path": image_path,
        # What the guest's GPU check and the Fabric Manager version gate read: the catalog's defaults here.
        "driver_strategy": "preinstalled",
        "driver_version": None,
    }
    await portal.release(alloc)
    await portal.wait_state(alloc, "released", timeout=90)


async def test_admin_api_update_enable_disable(stack: Stack, portal, db) -> None:
    status, _ = await admin(stack, "GET", "/v1/images", token="wrong")
    assert status == 401
    status, row = await admin(
        stack, "PATCH", f"/v1/images/{SLUG}", {"driver_strategy": "cloud_init", "metadata": {"title": "CUDA dev image"}}
    )
    assert status == 200 and row["driver_strategy"] == "cloud_init" and row["metadata"]["title"] == "CUDA dev image"
    status, err = await admin(stack, "PATCH", f"/v1/images/{SLUG}", {"metadata": {"artifact_ref": "oci://x/y:z"}})
    assert status == 422 and err["error"]["code"] == "protected_metadata"

    status, row = await admin(stack, "POST", f"/v1/images/{SLUG}/disable")
    assert status == 200 and row["status"] == "disabled"
    await portal.spy.wait_type("image.deactivated", slug=SLUG)
    # Seen on the bus is not yet applied by the allocator (its own consumer): a request racing the deactivation
    # is accepted with the image it still knew. CI lost that race on a loaded machine.
    await allocator_offers(db, SLUG, None)
    rejected_id = uuid.uuid4()
    await portal.request("gpu_slice", gpus=1, image=SLUG, allocation_id=rejected_id)
    rejected = await portal.spy.wait_type("allocation.rejected", allocation_id=rejected_id)
    assert "image" in rejected["payload"]["reason_code"]

    before = len(portal.spy.of_type("image.activated", slug=SLUG))
    status, row = await admin(stack, "POST", f"/v1/images/{SLUG}/enable")
    assert status == 200 and row["status"] == "active"  # every host still holds it verified
    await portal.spy.wait_for(
        lambda: len(portal.spy.of_type("image.activated", slug=SLUG)) > before, what="re-activation announced"
    )

    status, created = await admin(stack, "POST", "/v1/images", {"slug": "scratch-image"})
    assert status == 201 and created["status"] == "disabled"
    assert (await admin(stack, "POST", "/v1/images", {"slug": "scratch-image"}))[0] == 409
    assert (await admin(stack, "POST", "/v1/images/scratch-image/enable"))[0] == 409  # nothing built yet
    assert (await admin(stack, "DELETE", "/v1/images/scratch-image"))[0] == 200
    assert (await admin(stack, "GET", "/v1/images/scratch-image"))[0] == 404

    status, plan = await admin(
        stack,
        "POST",
        f"/v1/images/{SLUG}/builds",
        # A dry run plans a source that does not exist yet, in the directories sources may come from (the dev
        # stack's include the system temp dir).
        {"source": str(Path(tempfile.gettempdir()) / "nonexistent.qcow2"), "dry_run": True, "tag": "planned-1"},
    )
    assert status == 200 and plan["status"] == "planned"
    assert plan["plan"]["artifact_ref"] == f"oci://{stack.registry_host}/slice-guest-images/{SLUG}:planned-1"


async def test_cli_build_wait_and_status(stack: Stack, known_hosts, tmp_path: Path) -> None:
    gpuaas = str(Path(sys.executable).parent / "gpuaas")
    common = ["--admin-url", stack.image_admin_url, "--token", stack.image_admin_token]
    source = make_source(tmp_path / "cli.qcow2", 0x22)
    res = await asyncio.to_thread(
        subprocess.run,
        [
            gpuaas,
            "images",
            "build",
            "--slug",
            "cli-image",
            "--source",
            str(source),
            "--wait",
            "--json",
            "--timeout",
            "120",
            "--nats-url",
            stack.nats_url,
            "--run-dir",
            str(stack.run_dir),
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] and out["image"]["status"] == "active"
    assert out["image"]["digest_sha256"] == sha256(Path(out["build"]["raw_path"]))
    res = await asyncio.to_thread(
        subprocess.run,
        [gpuaas, "images", "status", "cli-image", "--json", *common],
        capture_output=True,
        text=True,
        timeout=60,
    )
    status = json.loads(res.stdout)
    assert [n["status"] for n in status["nodes"]] == ["verified"] * len(known_hosts)
    res = await asyncio.to_thread(
        subprocess.run, [gpuaas, "images", "list", "--json", *common], capture_output=True, text=True, timeout=60
    )
    assert "cli-image" in {i["slug"] for i in json.loads(res.stdout)["images"]}


class CorruptingProxy:
    """Loopback proxy in front of the registry that flips one byte of every blob it serves."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = 0
        self.corrupted = 0
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with http.request(
                request.method,
                f"http://{self.upstream}{request.path_qs}",
                headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
                data=await request.read(),
                allow_redirects=False,
            ) as up:
                body = bytearray(await up.read())
                if "/blobs/sha256:" in request.path and request.method == "GET" and len(body) > 64 << 10:
                    body[len(body) // 2] ^= 0xFF
                    self.corrupted += 1
                headers = {
                    k: v
                    for k, v in up.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection")
                }
                return web.Response(status=up.status, body=bytes(body), headers=headers)

    async def start(self) -> "CorruptingProxy":
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


class InProcessAgent:
    """The real node-agent prewarm handler for one extra host, fed from its task subject."""

    def __init__(self, js, prewarmer: ImagePrewarmer, node_id: str) -> None:
        self.js = js
        self.prewarmer = prewarmer
        self.node_id = node_id
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> "InProcessAgent":
        sub = await self.js.pull_subscribe(
            f"gpuaas.node.{self.node_id}.tasks.image.cache_prewarm",
            durable=f"test-agent-{uuid.uuid4().hex[:8]}",
            stream="NODE_TASKS",
        )
        self._task = asyncio.create_task(self._loop(sub))
        return self

    async def _loop(self, sub) -> None:
        # The flag as well as the cancel: Python 3.11's wait_for (inside nats-py's fetch) can lose a cancel that
        # lands as its timeout fires, and this loop would then fetch on for good (a CI run hung here).
        while not self._stopping:
            try:
                msgs = await sub.fetch(4, timeout=0.5)
            except asyncio.TimeoutError:
                continue
            for msg in msgs:
                env, payload = parse_message(msg.subject, msg.data)
                if env.type == "image.cache_prewarm":
                    await self.prewarmer.on_task(HandlerContext(env, payload, msg.subject, "test", 1))
                await msg.ack()

    async def stop(self) -> None:
        self._stopping = True
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture
async def late_host(stack: Stack, portal, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    proxy = await CorruptingProxy(stack.registry_host).start()
    bus = Bus(None, portal.js, service="node-agent", schema=None, pool=None)
    paths = HostPaths(tmp_path / "late-host")
    store = StateStore(tmp_path / "late-agent.sqlite")
    corrupt = ImagePrewarmer(
        LATE,
        paths,
        store,
        bus.publish,
        image_cache_dir="/var/lib/gpuaas/slice-images",
        registry_endpoint=f"127.0.0.1:{proxy.port}",
    )
    agent = await InProcessAgent(portal.js, corrupt, LATE).start()
    yield {"bus": bus, "paths": paths, "store": store, "proxy": proxy, "agent": agent}
    await agent.stop()
    await proxy.stop()


async def test_corrupted_pull_reports_mismatch_and_blocks_activation(
    stack: Stack, portal, db, known_hosts, late_host, tmp_path: Path
) -> None:
    bus: Bus = late_host["bus"]
    await bus.publish(
        "node.enrolled",
        m.NodeEnrolled(node_id=LATE, kind="slice_host", hostname="late-1", agent_version="test"),
        correlation_id=LATE,
        node_id=LATE,
    )
    # The already-active image is offered to the late host; corrupted bytes are refused.
    changed = await portal.spy.wait_type(
        "image.node_cache_changed", timeout=60, node_id=LATE, slug=SLUG, status="mismatch"
    )
    assert changed["payload"]["schedulable"] is False
    assert late_host["proxy"].corrupted >= 1
    assert not late_host["paths"].host(f"/var/lib/gpuaas/slice-images/{SLUG}.raw").exists()
    _, image = await admin(stack, "GET", f"/v1/images/{SLUG}")
    assert image["status"] == "active"  # a joining host does not take the image away from the others
    assert {n["node_id"]: n["schedulable"] for n in image["nodes"]}[LATE] is False

    # A new image is never activated while one known host holds mismatching bytes.
    status, build = await admin(
        stack, "POST", f"/v1/images/{NEXT}/builds", {"source": str(make_source(tmp_path / "next.qcow2", 0x11))}
    )
    assert status == 202, build
    build = await wait_build(stack, build["build_id"])

    async def settled() -> dict | None:
        rows = await cache_rows(db, NEXT)
        final = {n: r["status"] for n, r in rows.items() if r["status"] in ("verified", "mismatch")}
        return rows if len(final) == len(known_hosts) + 1 else None

    rows = await eventually(settled, timeout=90, what="every host reported on the new image")
    assert rows[LATE]["status"] == "mismatch" and rows[LATE]["digest_sha256"] != build["raw_sha256"]
    assert all(rows[h]["status"] == "verified" and rows[h]["digest_sha256"] == build["raw_sha256"] for h in known_hosts)
    _, image = await admin(stack, "GET", f"/v1/images/{NEXT}")
    assert image["status"] == "published"
    assert not portal.spy.of_type("image.activated", slug=NEXT)
    rejected_id = uuid.uuid4()
    await portal.request("gpu_slice", gpus=1, image=NEXT, allocation_id=rejected_id)
    await portal.spy.wait_type("allocation.rejected", allocation_id=rejected_id)

    # Once the host pulls clean bytes (straight from the registry), the gate opens.
    await late_host["agent"].stop()
    clean = ImagePrewarmer(
        LATE, late_host["paths"], late_host["store"], bus.publish, image_cache_dir="/var/lib/gpuaas/slice-images"
    )
    agent = await InProcessAgent(portal.js, clean, LATE).start()
    try:
        status, _ = await admin(stack, "POST", f"/v1/images/{NEXT}/prewarm")
        assert status == 202
        await portal.spy.wait_type("image.activated", timeout=60, slug=NEXT)
        assert sha256(late_host["paths"].host(f"/var/lib/gpuaas/slice-images/{NEXT}.raw")) == build["raw_sha256"]
    finally:
        await agent.stop()
