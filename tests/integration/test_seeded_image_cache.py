"""A seeded slice image's cache state comes from the hosts, across processes: a real `gpuaas-image-pipeline`
process seeds the catalog from a seed file, real slice-host agents (the production wiring, run_slice_host, on
generated host trees, as the simulated fleet runs them) start and enrol over a real nats-server, the pipeline
asks each to check its cache, and `gpuaas images status` shows what each host really holds: the host whose
provisioning placed the image verified and schedulable, the host without it absent, the host with other bytes
at that path a mismatch. A host whose image vanished while its agent was down says so at its next start.
Every message on `gpuaas.>` is checked against the contract."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gpuaas_common.migrations import apply_migrations
from gpuaas_common.natsconn import NatsIdentity
from gpuaas_dev.seed_images import IMAGE_CACHE_DIR, SLICE_SLUG, build_seed
from gpuaas_dev.sim.fixture_host import build_host_root, xe9680l
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.servers import NatsServer
from gpuaas_dev.testing.waiting import eventually, service_ready
from gpuaas_node_agent.adapters.host_link import HostLink
from gpuaas_node_agent.entrypoints.host import run_slice_host
from gpuaas_node_agent.settings import AgentSettings

BIN = Path(sys.executable).parent
TOKEN = "seeded-cache-test-token"
MIB = 1 << 20


@pytest.fixture
def nats(tmp_path: Path):
    # A server of its own: the pipeline's durables must not see enrolments other tests left on a shared one.
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
async def pipeline(nats, fresh_db, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """A real `gpuaas-image-pipeline` process seeded with the dev stack's seed images."""
    images = tmp_path / "images"
    seed_file = build_seed(images)
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "image_pipeline", "gpuaas_image_pipeline.migrations")
    await conn.close()
    ready = tmp_path / "pipeline.ready"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")},
        "GPUAAS_NATS_URL": nats.url,
        "GPUAAS_NATS_INSECURE_DEV": "true",
        "GPUAAS_DATABASE_URL": fresh_db,
        "GPUAAS_READY_FILE": str(ready),
        "GPUAAS_HEALTH_PORT": "0",
        "GPUAAS_ADMIN_PORT": "0",
        "GPUAAS_ADMIN_TOKEN": TOKEN,
        "GPUAAS_IMAGE_SEED_FILE": str(seed_file),
        "GPUAAS_IMAGE_BUILD_DIR": str(tmp_path / "builds"),
        "GPUAAS_HOST_IMAGE_DIR": str(tmp_path / "host-images"),
    }
    log_path = tmp_path / "pipeline.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(str(BIN / "gpuaas-image-pipeline"), env=env, stdout=log, stderr=log)
        try:
            await service_ready(ready, proc, log_path)
            info = json.loads(ready.read_text())
            yield {
                "admin_url": f"http://127.0.0.1:{info['admin_port']}",
                "images": images,
                "digest": json.loads(seed_file.read_text())[0]["digest_sha256"],
                "dsn": fresh_db,
            }
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)


class Host:
    """One slice host: a generated host tree and the production agent wiring on its own bus link."""

    def __init__(self, nats_url: str, node_id: str, root: Path) -> None:
        self.node_id = node_id
        self.root = root
        build_host_root(root, xe9680l(node_id, disk_file_bytes=MIB))
        hypervisor = root / "var/lib/gpuaas/sim-hypervisor.xml"
        hypervisor.parent.mkdir(parents=True, exist_ok=True)
        hypervisor.write_text("<node>\n</node>\n")  # a private, empty test hypervisor per host
        self.cache = root / IMAGE_CACHE_DIR.lstrip("/")
        self.cache.mkdir(parents=True, exist_ok=True)
        self.settings = AgentSettings(
            nats_url=nats_url,
            node_id=node_id,
            host_root=str(root),
            libvirt_uri=f"test://{hypervisor}",
            image_cache_dir=IMAGE_CACHE_DIR,
            reconcile_interval_s=3600,
        )
        self.link: HostLink | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        # The test's bus is a plaintext loopback server, named as such.
        identity = NatsIdentity([self.settings.nats_url], None, None, insecure_dev=True)
        self.link = HostLink(self.node_id, identity, retry_delays_s=(0.05,))
        self.task = asyncio.create_task(
            run_slice_host(self.settings, self.node_id, f"{self.node_id}.test", self.root, 22, self.link)
        )

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            assert self.task.cancelled() or self.task.exception() is None
        if self.link is not None:
            await self.link.close()


@pytest.fixture
async def hosts(nats, tmp_path: Path) -> AsyncIterator[dict[str, Host]]:
    tag = uuid.uuid4().hex[:6]
    made = {
        name: Host(nats.url, f"seed-{name}-{tag}", tmp_path / f"host-{name}") for name in ("holds", "lacks", "other")
    }
    yield made
    await asyncio.gather(*(h.stop() for h in made.values()))


async def images_status(admin_url: str) -> dict[str, Any]:
    res = await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "gpuaas"), "images", "status", SLICE_SLUG, "--admin-url", admin_url, "--token", TOKEN, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


async def test_hosts_prove_what_they_hold_of_a_seeded_image(nats, pipeline, hosts) -> None:
    spy = await BusSpy(nats.url).start()
    try:
        digest = pipeline["digest"]
        raw = pipeline["images"] / f"{SLICE_SLUG}.raw"
        # Provisioning placed the image on one host (as the simulated fleet does), none on another, and
        # other bytes under the image's name on the third.
        shutil.copyfile(raw, hosts["holds"].cache / raw.name)
        (hosts["other"].cache / raw.name).write_bytes(b"not the seeded image" * 1000)
        for h in hosts.values():
            h.start()

        ids = {h.node_id: name for name, h in hosts.items()}

        async def settled() -> dict[str, dict[str, Any]] | None:
            body = await images_status(pipeline["admin_url"])
            nodes = {ids[n["node_id"]]: n for n in body["nodes"] if n["node_id"] in ids}
            done = len(nodes) == 3 and all(n["status"] != "absent" or n["reason"] for n in nodes.values())
            return nodes if done else None

        nodes = await eventually(settled, timeout=90, interval=0.3, what="every host answered for the seeded image")
        assert (nodes["holds"]["status"], nodes["holds"]["schedulable"], nodes["holds"]["digest_sha256"]) == (
            "verified",
            True,
            digest,
        )
        assert nodes["holds"]["verified_at"]
        assert (nodes["lacks"]["status"], nodes["lacks"]["schedulable"]) == ("absent", False)
        assert "not in this host's image cache" in nodes["lacks"]["reason"]
        assert (nodes["other"]["status"], nodes["other"]["schedulable"]) == ("mismatch", False)
        assert nodes["other"]["digest_sha256"] not in (None, digest)
        # What the scheduler learns: only the host holding the image may take slices on it.
        changed = {
            ids[e["payload"]["node_id"]]: e["payload"]["schedulable"]
            for e in spy.of_type("image.node_cache_changed", slug=SLICE_SLUG)
            if e["payload"]["node_id"] in ids
        }
        assert changed == {"holds": True, "lacks": False, "other": False}
        # The check pulled nothing (there is no artifact) and the bytes on the hosts are as they were.
        assert not spy.of_type("node.image_cache_reported", status="pulling")
        assert not (hosts["lacks"].cache / raw.name).exists()

        # The human table says the same.
        res = await asyncio.to_thread(
            subprocess.run,
            [
                str(BIN / "gpuaas"),
                "images",
                "status",
                SLICE_SLUG,
                "--admin-url",
                pipeline["admin_url"],
                "--token",
                TOKEN,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert res.returncode == 0, res.stderr
        line = next(x for x in res.stdout.splitlines() if hosts["holds"].node_id in x)
        assert "verified" in line and "yes" in line

        # The image is lost while the host's agent is down: at its next start the host says so.
        await hosts["holds"].stop()
        (hosts["holds"].cache / raw.name).unlink()
        hosts["holds"].start()

        async def lost() -> dict[str, Any] | None:
            body = await images_status(pipeline["admin_url"])
            node = next(n for n in body["nodes"] if n["node_id"] == hosts["holds"].node_id)
            return node if node["status"] == "absent" else None

        node = await eventually(lost, timeout=60, interval=0.3, what="the restarted host reports the image gone")
        assert node["schedulable"] is False
        await spy.wait_for(
            lambda: any(
                not e["payload"]["schedulable"]
                for e in spy.of_type("image.node_cache_changed", node_id=hosts["holds"].node_id, slug=SLICE_SLUG)
            ),
            what="the scheduler is told the host lost the image",
        )
    finally:
        await spy.stop()
    assert spy.violations == [], spy.violations[:3]
