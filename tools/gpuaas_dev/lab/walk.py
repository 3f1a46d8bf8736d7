"""`make lab`: one slice on a real VM and back, narrated.

A nats-server on loopback, the lab (namespace, bridge, dnsmasq, libvirtd, one loop-device slot), the slice
image built by the pipeline's steps and prewarmed into the host's cache, the production agent in the
namespace; then a provision and a release task over the bus, as the allocator sends them, a login with the
tenant's key in between, and the lab taken down. What it prints is the transcript: phases with their
seconds, the login, the wipe proof. The scheduler's half (placing an allocation on a lab slot) is not here:
slots without a GPU are not placeable yet.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats

from gpuaas_common.jetstream import provision

from ..testing.servers import NatsServer
from .agent import LabAgentConfig, image_cache_dir, start_agent
from .lab import Lab
from .slice_image import ensure_slice_image, prewarm
from .tasks import provision_task, release_task, send

NODE = "lab-host-1"


async def _task(nc: Any, results: asyncio.Queue, task_type: str, task: dict[str, Any], timeout: float):
    await send(nc, task_type, task)
    while True:
        payload = await asyncio.wait_for(results.get(), timeout)
        if payload["task_id"] == task["task_id"]:
            return payload


async def walk(run_dir: Path, say: Callable[[str], None] = print) -> bool:
    """`run_dir`: an absolute path (the lab's state, logs and disks go there)."""
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    t0 = time.monotonic()

    def line(text: str) -> None:
        say(f"[{time.monotonic() - t0:7.1f}s] {text}")

    server = NatsServer(run_dir / "nats").start()
    lab = Lab(run_dir / "lab", slots=1)
    try:
        st = lab.up(forwards={"nats": server.port})
        line(f"lab up: namespace {st.netns}, bridge {st.bridge} {st.bridge_cidr}, libvirt {st.libvirt_uri}")
        slot = st.slots[0]
        line(
            f"slot disk {slot.by_id} -> {slot.loop_device} ({slot.size_bytes >> 30} GiB), {slot.mac} {slot.private_ip}"
        )
        image = await ensure_slice_image()
        how = "built" if image.built else "reused (content-addressed cache)"
        line(f"slice image {image.slug} {how}: sha256 {image.sha256[:16]}…, packages {image.packages}")
        cached = await prewarm(image, image_cache_dir(lab))
        line(f"prewarmed into the host cache at {cached}, re-hashed to the catalog digest")

        nc = await nats.connect(server.url)
        await provision(nc.jetstream())
        results: asyncio.Queue = asyncio.Queue()

        async def on_report(msg: Any) -> None:
            env = json.loads(msg.data)
            p = env["payload"]
            if env["type"] == "node.task_progress":
                line(f"  {p['task_type']} phase {p['phase']}" + (f" ({p['detail']})" if p.get("detail") else ""))
            elif env["type"] == "node.task_result":
                await results.put(p)
            elif env["type"] == "node.enrolled":
                line(f"agent enrolled: {p['node_id']} as {p['kind']}")

        await nc.subscribe(f"gpuaas.node.{NODE}.report.>", cb=on_report)
        start_agent(lab, LabAgentConfig(node_id=NODE, nats_url=server.url))
        key = run_dir / "tenant_ed25519"
        for old in (key, key.with_suffix(".pub")):
            await asyncio.to_thread(old.unlink, missing_ok=True)
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)]
        await asyncio.to_thread(subprocess.run, keygen, check=True)
        keys = [key.with_suffix(".pub").read_text().strip()]
        image_ref = {"slug": image.slug, "digest_sha256": image.sha256, "image_path": str(cached)}
        prov = provision_task(st, NODE, image_ref, keys)
        alloc = prov["allocation_id"]
        line(f"slice.vm_provision {prov['vm_name']} (allocation {alloc})")
        res = await _task(nc, results, "slice.vm_provision", prov, 900)
        if res["status"] != "succeeded":
            line(f"provision {res['status']}: {res['reason_code']}: {res['reason']}")
            return False
        ready = res["readiness"]
        secs = " ".join(f"{k}={v:.1f}s" for k, v in ready["phase_seconds"].items())
        line(f"active: {ready['ssh_user']}@{ready['actual_ip']} host key {ready['host_key_fingerprint']}")
        line(f"phases: {secs}")
        login = await asyncio.to_thread(
            subprocess.run,
            lab.ns(
                "ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                "-o", f"UserKnownHostsFile={run_dir / 'known_hosts'}", "-i", str(key),
                f"{ready['ssh_user']}@{ready['actual_ip']}", "hostname; lsblk -bdno NAME,SIZE /dev/vda",
            ),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        line(f"tenant login (exit {login.returncode}): {login.stdout.strip()!r}")
        rel = release_task(prov)
        line("slice.vm_release")
        res = await _task(nc, results, "slice.vm_release", rel, 600)
        for proof in res["wipe_proofs"]:
            line(f"wipe proof: {proof['method']} verified={proof['verified']}: {proof['verification']}")
        await nc.drain()
        line(f"release {res['status']}")
        return res["status"] == "succeeded" and login.returncode == 0
    finally:
        problems = lab.down()
        server.stop()
        line("lab down: " + ("everything removed" if not problems else f"left behind: {problems}"))
