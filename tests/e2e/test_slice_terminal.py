"""The slice terminal end to end across processes (issue 26, point 8): a websocket client (the portal acting for a
tenant) → the allocator's terminal endpoint (a real `gpuaas-allocator`) → NATS (a real nats-server) → the host's
agent (a real `gpuaas-node-agent` on a generated host tree) → `ssh -tt` with the relay key the agent made at its
start into a private sshd on loopback standing in for the guest (its host key is the one the guest's seed planted)
→ a command's output back on the websocket; the audit row checked after.

Every message on `gpuaas.>` and every terminal answer on the inboxes is checked against the committed contract.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import nats
import pytest

from gpuaas_allocator.adapters.repository import AllocationRepository
from gpuaas_allocator.domain.model import ActiveImage
from gpuaas_allocator.domain.portal_assertion import TenantAssertion, sign
from gpuaas_allocator.service_layer.commands import provision_task_id
from gpuaas_allocator.service_layer.handlers import Allocator
from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_dev.sim.fixture_host import MIB, build_host_root, xe9680l
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.servers import free_port
from gpuaas_dev.testing.waiting import eventually, service_ready
from gpuaas_node_agent.adapters.guest_ssh import RELAY_KEY, HostKey, new_host_key
from gpuaas_node_agent.adapters.state_store import StateStore

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
SLICE = ActiveImage("ubuntu-24.04-h200-slice", "slice", "h200-sxm-slice", "c" * 64, "/img/slice.raw")
NODE = "term-n1"
TENANT = "tenant-a"
ASSERTION_SECRET = "portal-assertion-key-of-the-terminal-test"
USER = "alice@tenant-a"
VM = "gpuaas-slice-terminal-test"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
STATE_DIR = Path("var/lib/gpuaas/agent")  # the agent's default state and seed dirs, under the host's root
SEED_DIR = Path("var/lib/gpuaas/seeds")
TERMINAL_REPLIES = {"terminal.input", "terminal.output_ack"}


async def _banner(port: int) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        return (await asyncio.wait_for(reader.readline(), 5)).startswith(b"SSH-2.0-")
    except (TimeoutError, OSError):
        return False
    finally:
        writer.close()


async def _send(pool: asyncpg.Pool, handler, type_: str, payload: m.Payload) -> None:
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="c")
    work = UnitOfWork(pool, "allocator", "allocator", AllocationRepository)
    await deliver(handler, HandlerContext(env, payload, "s", "test", 1), work)


async def _allocation(pool: asyncpg.Pool, tenant: str, *, active: bool) -> uuid.UUID:
    """A slice allocation of `tenant` on NODE, driven through the allocator's own handlers: requested, placed on
    one slot whose guest is the private sshd, and (if `active`) provisioned with readiness evidence."""
    allocator = Allocator(AllocatorSettings())
    alloc = uuid.uuid4()
    request = m.AllocationRequested(
        allocation_id=alloc,
        tenant_id=tenant,
        shape="gpu_slice",
        sku="h200-sxm-slice",
        gpu_count=1,
        image=SLICE.slug,
        ssh_public_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGNsaS10ZXN0 t@test"],
    )
    await _send(pool, allocator.on_requested, "allocation.requested", request)
    slot = m.SlotBinding(
        slot_id=f"{NODE}-{alloc.hex[:6]}",
        gpu_pci_address="0000:18:00.0",
        nvme_by_id="nvme-x",
        fabric_vf_pci_address="0000:19:00.2",
        mac="52:54:00:00:00:01",
        private_ip="127.0.0.1",
        ovs_bridge="br-slice",
        profile="h200-slice",
    )
    placed = m.PlacementPlaced(allocation_id=alloc, node_id=NODE, claim_mode="slots", slots=[slot], fencing_epoch=1)
    await _send(pool, allocator.on_placed, "placement.placed", placed)
    if active:
        result = m.NodeTaskResult(
            task_id=provision_task_id(allocator.settings, alloc),
            allocation_id=alloc,
            node_id=NODE,
            task_type="slice.vm_provision",
            status="succeeded",
            readiness=m.Readiness(
                mac=slot.mac, expected_ip="127.0.0.1", actual_ip="127.0.0.1", lease_state="bound", ssh_ready=True
            ),
        )
        await _send(pool, allocator.on_task_result, "node.task_result", result)
    return alloc


@dataclass
class Stack:
    pool: asyncpg.Pool
    terminal_port: int
    host_root: Path
    # The tenant's active slice, whose guest is the private sshd.
    active: uuid.UUID


def remember_guest(host_root: Path, alloc: uuid.UUID) -> None:
    """The host's own record of the guest it provisioned (what its provision task stores), the terminal's only
    source for where the guest is."""
    store = StateStore(host_root / STATE_DIR / "agent.sqlite")
    task_id = f"provision-{alloc}"
    payload = {"allocation_id": str(alloc), "vm_name": VM, "slots": [{"slot_id": "s0", "private_ip": "127.0.0.1"}]}
    store.start_task(task_id, "slice.vm_provision", str(alloc), vm_name=VM, payload=payload)
    store.finish_task(task_id, "succeeded", {"status": "succeeded"})
    store.close()


class Processes:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.running: list[tuple[asyncio.subprocess.Process, Any]] = []

    async def start(self, name: str, *argv: str, env: dict[str, str]) -> asyncio.subprocess.Process:
        log = (self.tmp_path / f"{name}.log").open("wb")
        proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=log, stderr=log)
        self.running.append((proc, log))
        return proc

    async def stop(self) -> None:
        for proc, log in reversed(self.running):
            if proc.returncode is None:
                proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
            log.close()


def _sshd_config(sshd_dir: Path, port: int, host_key: Path, authorized: Path) -> str:
    return "\n".join(
        [
            f"Port {port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {host_key}",
            f"PidFile {sshd_dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized}",
            f"AllowUsers {getpass.getuser()}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PrintMotd no",
            "PrintLastLog no",
            "",
        ]
    )


@pytest.fixture
async def stack(nats_server, fresh_db: str, spy: BusSpy, tmp_path: Path) -> AsyncIterator[Stack]:
    """The allocator with its terminal endpoint on (a real `gpuaas-allocator`), the host's production agent (a
    real `gpuaas-node-agent` on a generated host tree and a private test hypervisor), and the guest: a private
    sshd on a loopback port whose host key is the one planted beside the guest's seed and which authorises, for
    the guest user, the relay key the agent made at its start (what the seed's cloud-init does in a guest)."""
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator", min_size=1, max_size=2)
    async with UnitOfWork(pool, "allocator", "allocator", AllocationRepository) as uow:
        await uow.repos.upsert_image(SLICE)
        await uow.commit()
    # The tenant's slice was provisioned before this test: driven to active through the allocator's own handlers
    # before the allocator runs, its provision task not sent again (the host's record of it is written below; a
    # host asked to provision it once more would refuse, and its refusal would be the allocation's latest word).
    active = await _allocation(pool, TENANT, active=True)
    await pool.execute("DELETE FROM outbox")
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_NATS_CREDS")}
    base |= {"GPUAAS_NATS_URL": nats_server.url, "GPUAAS_HEALTH_PORT": "0", "GPUAAS_LOG_LEVEL": "INFO"}
    procs = Processes(tmp_path)
    try:
        ready = tmp_path / "allocator.ready"
        env = base | {
            "GPUAAS_DATABASE_URL": fresh_db,
            "GPUAAS_READY_FILE": str(ready),
            "GPUAAS_TERMINAL_ASSERTION_SECRET": ASSERTION_SECRET,
            # Short, so that the test's ended session is answered promptly; the default is 10 s.
            "GPUAAS_TERMINAL_INPUT_HOLD_S": "2",
        }
        proc = await procs.start("allocator", str(BIN / "gpuaas-allocator"), env=env)
        await service_ready(ready, proc, tmp_path / "allocator.log")
        terminal_port = json.loads(ready.read_text())["terminal_port"]

        root = tmp_path / "host"
        build_host_root(root, xe9680l(NODE, disk_file_bytes=MIB))
        hypervisor = root / "var/lib/gpuaas/sim-hypervisor.xml"
        hypervisor.write_text("<node>\n</node>\n")  # a private, empty test hypervisor
        planted = new_host_key()
        seeds = root / SEED_DIR
        seeds.mkdir(parents=True, exist_ok=True)
        (seeds / f"{VM}.hostkey").write_text(planted.private_openssh)
        remember_guest(root, active)
        ssh_port = free_port()
        env = base | {
            "GPUAAS_NODE_ID": NODE,
            "GPUAAS_HOST_ROOT": str(root),
            "GPUAAS_LIBVIRT_URI": f"test://{hypervisor}",
            # The relay logs in as the console user (the seed's unprivileged one): here the sshd's only user.
            "GPUAAS_CONSOLE_USER": getpass.getuser(),
            "GPUAAS_SSH_PORT": str(ssh_port),
            "GPUAAS_RECONCILE_INTERVAL_S": "3600",
            "GPUAAS_READY_FILE": str(tmp_path / "agent.ready"),
        }
        agent = await procs.start("agent", str(BIN / "gpuaas-node-agent"), env=env)
        await eventually(
            lambda: agent.returncode is not None or spy.of_type("node.enrolled", node_id=NODE),
            timeout=120,
            what="the host's agent enrolled",
        )
        assert agent.returncode is None, (tmp_path / "agent.log").read_text()[-3000:]
        relay_public = HostKey.from_private((root / STATE_DIR / RELAY_KEY).read_text()).public_line

        sshd_dir = tmp_path / "sshd"
        sshd_dir.mkdir(mode=0o700)
        host_key = sshd_dir / "host_ed25519"
        host_key.touch(mode=0o600)
        host_key.write_text(planted.private_openssh)
        authorized = sshd_dir / "authorized_keys"
        authorized.write_text(relay_public + "\n")
        config = sshd_dir / "sshd_config"
        config.write_text(_sshd_config(sshd_dir, ssh_port, host_key, authorized))
        # The privilege-separation directory a root sshd insists on (the package's unit makes it; none runs here).
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        sshd = await procs.start("sshd", SSHD, "-D", "-e", "-f", str(config), env=dict(os.environ))
        await eventually(
            lambda: sshd.returncode is not None or _banner(ssh_port), timeout=30, what="the private sshd's banner"
        )
        assert sshd.returncode is None, (tmp_path / "sshd.log").read_text()[-2000:]
        yield Stack(pool, terminal_port, root, active)
    finally:
        await procs.stop()
        await pool.close()


@pytest.fixture
async def replies(nats_server) -> AsyncIterator[list[dict]]:
    """The allocator's terminal answers as they reach the host's inbox, each checked against the contract."""
    validator = default_validator()
    seen: list[dict] = []
    violations: list[str] = []
    nc = await nats.connect(nats_server.url)

    async def on_msg(msg) -> None:
        try:
            body = json.loads(msg.data)
        except ValueError:
            return  # PubAcks and pulled task messages share the inbox space; only terminal answers are ours
        if isinstance(body, dict) and body.get("type") in TERMINAL_REPLIES:
            try:
                seen.append(validator.validate(msg.subject, msg.data))
            except Exception as exc:  # noqa: BLE001 - recorded and asserted below
                violations.append(str(exc))

    await nc.subscribe("_INBOX.>", cb=on_msg)
    await nc.flush()
    yield seen
    await nc.drain()
    assert violations == [], violations[:3]


@pytest.fixture
async def spy(nats_server) -> AsyncIterator[BusSpy]:
    s = await BusSpy(nats_server.url).start()
    yield s
    await s.stop()
    assert s.violations == [], s.violations[:5]


def _url(port: int, alloc: uuid.UUID) -> str:
    return f"http://127.0.0.1:{port}/v1/allocations/{alloc}/terminal"


def _headers(
    tenant: str = TENANT, *, secret: str = ASSERTION_SECRET, lives_s: int = 60, x_tenant: str | None = None
) -> dict[str, str]:
    """What the portal sends: its signed assertion of the tenant and the signed-in person."""
    token = sign(secret.encode(), TenantAssertion(tenant, USER, int(time.time()) + lives_s))
    return {"Authorization": f"Bearer {token}"} | ({"X-Tenant-Id": x_tenant} if x_tenant else {})


async def _read_until(ws: aiohttp.ClientWebSocketResponse, marker: bytes, seen: bytearray) -> list[dict]:
    """Binary frames into `seen` until `marker` shows; the text notices met on the way."""
    notices = []
    while marker not in seen:
        msg = await ws.receive(timeout=60)
        if msg.type == aiohttp.WSMsgType.BINARY:
            seen += msg.data
        elif msg.type == aiohttp.WSMsgType.TEXT:
            notices.append(json.loads(msg.data))
        else:
            raise AssertionError(f"socket ended before {marker!r}: {msg.type} {bytes(seen)[-500:]!r}")
    return notices


async def test_a_tenant_runs_a_command_in_its_slice_through_the_relay_and_the_session_is_audited(
    stack: Stack, spy: BusSpy, replies: list[dict]
) -> None:
    pool, port, alloc = stack.pool, stack.terminal_port, stack.active

    async with aiohttp.ClientSession() as http, http.ws_connect(_url(port, alloc), headers=_headers()) as ws:
        ready = await ws.receive_json(timeout=60)
        assert ready["type"] == "session_ready", ready
        session_id = uuid.UUID(ready["session_id"])
        # One live session per allocation: a second websocket is refused before the upgrade, nothing sent.
        async with http.get(_url(port, alloc), headers=_headers()) as second:
            body = await second.json()
            assert (second.status, body["error"]["code"]) == (409, "terminal_in_use"), body
        seen = bytearray()
        # Split so that the marker appears only in the command's output, never in the echo of what was typed.
        await ws.send_bytes(b"echo terminal-$((6*7))-ok; id -un\n")
        await _read_until(ws, b"terminal-42-ok", seen)
        await _read_until(ws, getpass.getuser().encode(), seen)
        await ws.send_bytes(b"exit\n")
        closing: list[dict] = []
        while True:
            msg = await ws.receive(timeout=60)
            if msg.type == aiohttp.WSMsgType.TEXT:
                closing.append(json.loads(msg.data))
            elif msg.type == aiohttp.WSMsgType.BINARY:
                seen += msg.data
            else:
                break
    assert closing and closing[-1]["type"] == "closed" and closing[-1]["reason"] == "guest_closed", closing

    row = await eventually(
        lambda: pool.fetchrow(
            "SELECT * FROM terminal_sessions WHERE session_id = $1 AND ended_at IS NOT NULL", session_id
        ),
        what="the session's audit row completed",
    )
    assert (row["allocation_id"], row["tenant_id"], row["node_id"]) == (alloc, TENANT, NODE)
    assert row["actor"] == f"user:{USER}"  # the person the portal asserted, not the portal
    assert row["end_reason"] == "guest_closed"
    assert row["ended_at"] >= row["started_at"]
    typed = len(b"echo terminal-$((6*7))-ok; id -un\n") + len(b"exit\n")
    assert row["bytes_to_guest"] == typed
    assert row["bytes_from_guest"] == len(seen)

    # What crossed the bus: the task to this host only, the host's requests on its own subjects, the answers.
    opened = spy.of_type("slice.terminal_open", session_id=session_id)
    assert len(spy.of_type("slice.terminal_open")) == 1
    assert len(opened) == 1 and opened[0]["payload"]["node_id"] == NODE
    subjects = {s for s, d in spy.messages if d.get("type") in ("node.terminal_output", "node.terminal_input")}
    assert subjects == {f"gpuaas.node.{NODE}.terminal.output", f"gpuaas.node.{NODE}.terminal.input"}
    assert {r["type"] for r in replies} == TERMINAL_REPLIES
    # The tenant's bytes were relayed, not stored: no stream holds a terminal subject.
    nc = await nats.connect(spy.url)
    try:
        with pytest.raises(nats.js.errors.NotFoundError):
            await nc.jetstream().find_stream_name_by_subject(f"gpuaas.node.{NODE}.terminal.output")
    finally:
        await nc.close()


async def test_a_terminal_into_another_tenants_or_an_ended_allocation_is_refused_with_nothing_sent(
    stack: Stack, spy: BusSpy
) -> None:
    pool, port = stack.pool, stack.terminal_port
    theirs = await _allocation(pool, "tenant-b", active=True)
    not_yet = await _allocation(pool, TENANT, active=False)
    ended = await _allocation(pool, TENANT, active=True)
    release = m.AllocationReleaseRequested(allocation_id=ended, reason="tenant done")
    await _send(pool, Allocator(AllocatorSettings()).on_release_requested, "allocation.release_requested", release)
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", ended) == "releasing"
    async with aiohttp.ClientSession() as http:
        for alloc, headers, status, code in (
            (theirs, _headers(), 404, "unknown_allocation"),
            (uuid.uuid4(), _headers(), 404, "unknown_allocation"),
            (not_yet, _headers(), 409, "allocation_not_active"),
            (ended, _headers(), 409, "allocation_not_active"),
            # A portal identity opens only its own tenant's consoles: a header naming another changes nothing.
            (theirs, _headers(x_tenant="tenant-b"), 404, "unknown_allocation"),
            (theirs, _headers("tenant-b", secret="not-the-portals-key-but-as-long-as-it"), 401, "unauthorized"),
            (stack.active, _headers(lives_s=-1), 401, "unauthorized"),
            (
                stack.active,
                {"Authorization": "Bearer portal-token-of-the-terminal-test", "X-Tenant-Id": TENANT},
                401,
                "unauthorized",
            ),
            (theirs, {"X-Tenant-Id": "tenant-b"}, 401, "unauthorized"),
        ):
            async with http.get(_url(port, alloc), headers=headers) as resp:
                body = await resp.json()
                assert (resp.status, body["error"]["code"]) == (status, code), (alloc, body)
                assert body["error"]["message"]
    assert await pool.fetchval("SELECT count(*) FROM terminal_sessions") == 0
    assert spy.of_type("slice.terminal_open") == []


async def test_two_replicas_the_host_reaches_only_the_one_holding_the_websocket(
    nats_server, fresh_db: str, spy: BusSpy, tmp_path: Path
) -> None:
    """Review 3, N3: every replica subscribed `gpuaas.node.*.terminal.*` with no queue group and took every host's
    every request. Now only the replica holding a session listens to that host, so exactly it answers; the other
    hears nothing. Two real `gpuaas-allocator` processes; the test is the host."""
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator", min_size=1, max_size=2)
    async with UnitOfWork(pool, "allocator", "allocator", AllocationRepository) as uow:
        await uow.repos.upsert_image(SLICE)
        await uow.commit()
    alloc = await _allocation(pool, TENANT, active=True)
    await pool.execute("DELETE FROM outbox")
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_NATS_CREDS")}
    base |= {"GPUAAS_NATS_URL": nats_server.url, "GPUAAS_HEALTH_PORT": "0", "GPUAAS_DATABASE_URL": fresh_db}
    base |= {"GPUAAS_TERMINAL_ASSERTION_SECRET": ASSERTION_SECRET, "GPUAAS_TERMINAL_INPUT_HOLD_S": "2"}
    procs = Processes(tmp_path)
    nc = await nats.connect(nats_server.url)
    try:
        ports = []
        for name in ("replica-a", "replica-b"):
            ready = tmp_path / f"{name}.ready"
            proc = await procs.start(name, str(BIN / "gpuaas-allocator"), env=base | {"GPUAAS_READY_FILE": str(ready)})
            await service_ready(ready, proc, tmp_path / f"{name}.log")
            ports.append(json.loads(ready.read_text())["terminal_port"])

        async def listeners(subject: str) -> int:
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{nats_server.monitor_port}/connz?subs=1"
                async with http.get(url) as resp:
                    conns = (await resp.json())["connections"]
            return sum(subject in c.get("subscriptions_list", []) for c in conns)

        input_subject = f"gpuaas.node.{NODE}.terminal.input"
        assert await listeners(input_subject) == 0  # no session anywhere: a host's requests reach no replica
        assert await listeners("gpuaas.node.*.terminal.*") == 0
        async with aiohttp.ClientSession() as http, http.ws_connect(_url(ports[0], alloc), headers=_headers()) as ws:
            session_id = await eventually(
                lambda: pool.fetchval("SELECT session_id FROM terminal_sessions WHERE ended_at IS NULL"),
                what="the session opened on replica a",
            )
            assert await listeners(input_subject) == 1
            assert await listeners(f"gpuaas.node.{NODE}.terminal.output") == 1
            # The other replica refuses a second session on the allocation: the claim is shared in Postgres.
            async with http.get(_url(ports[1], alloc), headers=_headers()) as second:
                assert (second.status, (await second.json())["error"]["code"]) == (409, "terminal_in_use")
            await ws.send_bytes(b"whoami\n")
            answers: list[dict] = []
            validator = default_validator()
            inbox = nc.new_inbox()

            async def on_answer(msg) -> None:
                answers.append(validator.validate(msg.subject, msg.data))

            await nc.subscribe(inbox, cb=on_answer)
            ask = m.NodeTerminalInput(session_id=session_id, node_id=NODE, received=0)
            env = Envelope.wrap(
                "node.terminal_input", ask.model_dump(mode="json"), producer="node-agent", correlation_id="h"
            )
            await nc.publish(input_subject, env.model_dump_json().encode(), reply=inbox)
            await eventually(lambda: len(answers) >= 1, what="the holding replica's answer")
            assert answers[0]["type"] == "terminal.input" and answers[0]["payload"]["status"] == "open"
            ready = await ws.receive_json(timeout=30)
            assert ready == {"type": "session_ready", "session_id": str(session_id)}
        # Still exactly one listener while the ended session lingers (its host hears `closed`), then none.
        assert await listeners(input_subject) <= 1
        assert len(answers) == 1
        row = await eventually(
            lambda: pool.fetchrow("SELECT * FROM terminal_sessions WHERE ended_at IS NOT NULL"),
            what="the session ended",
        )
        assert row["replica_id"] and row["actor"] == f"user:{USER}"
    finally:
        await nc.close()
        await procs.stop()
        await pool.close()


async def test_a_host_flooding_its_terminal_subjects_leaves_the_allocator_bounded_and_answering(
    nats_server, fresh_db: str, spy: BusSpy, tmp_path: Path
) -> None:
    """Review 3, N3 across the process boundary: a host publishing input asks at full speed, for its live
    session and for sessions nobody holds, leaves a real allocator's answers in flight at most its per-host
    bound and its held bytes under the buffers' bound, counted as dropped, while it still answers queries."""
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator", min_size=1, max_size=2)
    async with UnitOfWork(pool, "allocator", "allocator", AllocationRepository) as uow:
        await uow.repos.upsert_image(SLICE)
        await uow.commit()
    alloc = await _allocation(pool, TENANT, active=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_NATS_CREDS")}
    base |= {"GPUAAS_NATS_URL": nats_server.url, "GPUAAS_HEALTH_PORT": "0", "GPUAAS_DATABASE_URL": fresh_db}
    base |= {"GPUAAS_TERMINAL_ASSERTION_SECRET": ASSERTION_SECRET, "GPUAAS_TERMINAL_NODE_ANSWERS": "8"}
    procs = Processes(tmp_path)
    nc = await nats.connect(nats_server.url)
    ready = tmp_path / "allocator.ready"
    try:
        proc = await procs.start(
            "allocator", str(BIN / "gpuaas-allocator"), env=base | {"GPUAAS_READY_FILE": str(ready)}
        )
        await service_ready(ready, proc, tmp_path / "allocator.log")
        info = json.loads(ready.read_text())

        async def metrics() -> dict[str, float]:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{info['health_port']}/metrics") as resp:
                    text = await resp.text()
            out = {}
            for line in text.splitlines():
                if line.startswith("gpuaas_terminal_"):
                    name, value = line.rsplit(" ", 1)
                    out[name] = float(value)
            return out

        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(_url(info["terminal_port"], alloc), headers=_headers()) as ws,
        ):
            session_id = await eventually(
                lambda: pool.fetchval("SELECT session_id FROM terminal_sessions WHERE ended_at IS NULL"),
                what="the session opened",
            )
            inbox = nc.new_inbox()
            subject = f"gpuaas.node.{NODE}.terminal.input"

            def ask(sid: uuid.UUID) -> bytes:
                payload = m.NodeTerminalInput(session_id=sid, node_id=NODE, received=0)
                env = Envelope.wrap(
                    "node.terminal_input", payload.model_dump(mode="json"), producer="node-agent", correlation_id="f"
                )
                return env.model_dump_json().encode()

            own, stranger = ask(session_id), ask(uuid.uuid4())
            for _ in range(5000):
                await nc.publish(subject, own, reply=inbox)
                await nc.publish(subject, stranger, reply=inbox)
            await nc.flush()
            seen = await eventually(
                lambda: _flood_counted(metrics), timeout=60, what="every flooded request counted by the allocator"
            )
            assert seen["gpuaas_terminal_answering"] <= 8
            assert seen["gpuaas_terminal_buffered_bytes"] <= 256 * 1024 + 64 * 1024
            # Allocations still flow: the allocator answers a query during the flood's held asks.
            query = Envelope.wrap(
                "allocation.query", {"allocation_id": str(alloc)}, producer="portal", correlation_id="q"
            )
            answer = await nc.request(
                spec_for("allocation.query").subject(), query.model_dump_json().encode(), timeout=10
            )
            assert json.loads(answer.data)["payload"]["status"] == "found"
            await ws.close()
    finally:
        await nc.close()
        await procs.stop()
        await pool.close()


async def _flood_counted(metrics) -> dict[str, float] | None:
    """The allocator's terminal readings once it has dropped the 5000 strangers' asks and all but a bounded few
    of the 5000 of the session (answered at most 8 at a time, each held for input)."""
    seen = await metrics()
    unknown = seen.get('gpuaas_terminal_dropped_total{why="unknown_session"}', 0)
    busy = seen.get('gpuaas_terminal_dropped_total{why="node_busy"}', 0)
    return seen if unknown >= 5000 and busy >= 5000 - 8 * 20 else None
