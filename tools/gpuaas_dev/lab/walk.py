"""`make lab`: one slice allocated onto a real VM through the whole stack, and released, narrated.

The dev stack with the lab host (`dev up --lab`, no simulated slice host): the lab host is commissioned through
the MAAS simulator, discovers its emulated slot, runs parity and is approved through the scheduler's admin API;
the pipeline service publishes the lab's slice image and the host verifies it in its cache. Then the walk acts
as a portal: `allocation.requested` with a tenant key, the scheduler places it on the lab slot, the allocator
sends the task, the production agent boots the VM; the walk logs in as the tenant with the access the
allocation names, releases it and prints the wipe proof. What it prints is the transcript.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats

from gpuaas_common.contract import AllocationState, Envelope

from ..stack import Stack
from ..stack.lab_host import LAB_NODE, LAB_SKU
from .lab import Lab

TENANT = "lab-tenant"


class _Follower:
    """The allocation's lifecycle and the lab host's task reports, as they arrive."""

    def __init__(self, line: Callable[[str], None]) -> None:
        self.line = line
        self.states: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def on_msg(self, msg: Any) -> None:
        env = json.loads(msg.data)
        p = env["payload"]
        kind = env["type"]
        if kind == "node.task_progress":
            self.line(f"  {p['task_type']} phase {p['phase']}" + (f" ({p['detail']})" if p.get("detail") else ""))
        elif kind.startswith("allocation.") and kind not in ("allocation.requested", "allocation.release_requested"):
            await self.states.put(env)

    async def wait(self, alloc: str, wanted: set[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            env = await asyncio.wait_for(self.states.get(), max(0.1, deadline - time.monotonic()))
            if env["payload"].get("allocation_id") != alloc:
                continue
            state = env["type"].removeprefix("allocation.")
            p = env["payload"]
            where = f" on {p['node_id']}" if p.get("node_id") else ""
            self.line(
                f"allocation {state}{where}" + (f": {p['reason_code']}: {p['reason']}" if "reason_code" in p else "")
            )
            if state in wanted or state in (AllocationState.FAILED, AllocationState.UNSCHEDULABLE, "rejected"):
                return env


async def _publish(js: Any, type_: str, payload: dict[str, Any]) -> None:
    env = Envelope.wrap(type_, payload, producer="portal", correlation_id=payload["allocation_id"])
    await js.publish(f"gpuaas.{type_}", env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id})


def _tenant_login(lab: Lab, run_dir: Path, key: Path, access: dict[str, Any]) -> tuple[bool, str]:
    """Log in as the tenant with the access the allocation names, trusting only the host key it names."""
    known = run_dir / "known_hosts"
    scan = subprocess.run(
        lab.ns("ssh-keyscan", "-t", "ed25519", "-p", str(access["port"]), access["ip"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    known.write_text(scan.stdout)
    listed = subprocess.run(["ssh-keygen", "-lf", str(known)], capture_output=True, text=True).stdout.split()
    if len(listed) < 2 or listed[1] != access["host_key_fingerprint"]:
        return False, f"the guest's host key {listed[1:2]} is not the one the allocation names"
    login = subprocess.run(
        lab.ns(
            "ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={known}", "-i", str(key), "-p", str(access["port"]),
            f"{access['user']}@{access['ip']}", "hostname; lsblk -bdno NAME,SIZE /dev/vda",
        ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return login.returncode == 0, f"exit {login.returncode}: {(login.stdout or login.stderr).strip()!r}"


async def walk(run_dir: Path, say: Callable[[str], None] = print) -> bool:
    """`run_dir`: an absolute path (the stack's and the lab's state, logs and disks go there)."""
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    t0 = time.monotonic()

    def line(text: str) -> None:
        say(f"[{time.monotonic() - t0:7.1f}s] {text}")

    stack = Stack(run_dir / "stack", slice_hosts=0, baremetal_hosts=0, lab=True)
    netns: str | None = None
    line("dev stack with the lab host: NATS, Postgres, registry, MAAS simulator, five services; lab host onboarding")
    try:
        await asyncio.to_thread(stack.start)
        lab: Lab = stack.lab_host
        st = lab.state
        assert st is not None
        netns = st.netns
        slot = st.slots[0]
        line(f"lab up: namespace {st.netns}, bridge {st.bridge} {st.bridge_cidr}, libvirt {st.libvirt_uri}")
        line(f"slot disk {slot.by_id} -> {slot.loop_device} ({slot.size_bytes >> 30} GiB)")
        image = stack.lab_image
        line(
            f"{LAB_NODE} commissioned, discovered, parity passed (emulated profile), slot approved; image "
            f"{image['slug']} active through the pipeline (sha256 {image['digest_sha256'][:16]}…, verified in the "
            "host's cache)"
        )
        nc = await nats.connect(**stack.nats_options("admin"))
        follower = _Follower(line)
        await nc.subscribe("gpuaas.allocation.>", cb=follower.on_msg)
        await nc.subscribe(f"gpuaas.node.{LAB_NODE}.report.>", cb=follower.on_msg)
        key = run_dir / "tenant_ed25519"
        for old in (key, key.with_suffix(".pub")):
            await asyncio.to_thread(old.unlink, missing_ok=True)
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)]
        await asyncio.to_thread(subprocess.run, keygen, check=True)
        alloc = str(uuid.uuid4())
        js = nc.jetstream()
        await _publish(
            js,
            "allocation.requested",
            {
                "allocation_id": alloc,
                "tenant_id": TENANT,
                "shape": "gpu_slice",
                "sku": LAB_SKU,
                "gpu_count": 1,
                "image": image["slug"],
                "ssh_public_keys": [key.with_suffix(".pub").read_text().strip()],
            },
        )
        line(f"allocation.requested {alloc}: gpu_slice x 1, image {image['slug']}, the tenant's key")
        env = await follower.wait(alloc, {"active"}, 900)
        if env["type"] != "allocation.active":
            return False
        access = env["payload"]["access"]
        line(f"access: {access['user']}@{access['ip']}:{access['port']} host key {access['host_key_fingerprint']}")
        ok, said = await asyncio.to_thread(_tenant_login, lab, run_dir, key, access)
        line(f"tenant login: {said}")
        await _publish(js, "allocation.release_requested", {"allocation_id": alloc})
        env = await follower.wait(alloc, {"released"}, 600)
        cleanup = env["payload"].get("cleanup") or {}
        for proof in cleanup.get("wipe_proofs", []):
            line(f"wipe proof: {proof['method']} verified={proof['verified']}: {proof['verification']}")
        await nc.drain()
        return ok and env["type"] == "allocation.released" and bool(cleanup.get("verified"))
    finally:
        await asyncio.to_thread(stack.stop)
        left = bool(netns) and await asyncio.to_thread(Path(f"/run/netns/{netns}").exists)
        gone = stack.lab_host is None and not left
        line("stack and lab down: " + ("everything removed" if gone else f"namespace {netns} left behind"))
