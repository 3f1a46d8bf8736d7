"""One chaos run against a running dev stack (3-node NATS cluster, service replicas): a portal-like workload of
mixed slice and baremetal allocations and releases while a seeded fault injector kills -9 service replicas
(and restarts them), kills and restarts a NATS server, pauses processes, restarts Postgres (fast, immediate,
and once immediately while it runs with synchronous_commit off, which loses the last commits on purpose) and
makes the MAAS simulator time out, fail and drop answers after commit. Then the faults stop, everything is
healed, and the independent checker (invariants.py) reads the databases, the streams, the simulated hosts
and the MAAS simulator's counters twice: once with some allocations still active, once after every
allocation was released.

`bench/chaos.py` runs the long form; tests/e2e/test_chaos.py the short one (same code, small numbers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import asyncpg
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from gpuaas_common.contract import AllocationState as A
from gpuaas_common.contract import Envelope, Shape
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import CONSUMERS, node_agent_consumer

from ..stack import Stack
from .bus_spy import BusSpy
from .databases import ServiceDatabases
from .invariants import (
    TERMINAL,
    allocations_and_claims,
    database_violations,
    dead_letters,
    host_violations,
    lifecycle_violations,
    maas_violations,
    wait_consumers_drained,
    wait_outboxes_empty,
)
from .waiting import eventually

# Timers shortened so that a run converges in minutes instead of the production defaults' tens of minutes.
CHAOS_ENV: dict[str, Any] = {
    # allocator: re-ask the scheduler for a placement answer after 5 s (default 30 s); node tasks time out
    # after 90 s (default 20 min) with 5 s grace (default 60 s), swept every 2 s (default 10 s).
    "GPUAAS_PLACEMENT_REASK_AFTER_S": 5,
    "GPUAAS_TASK_DEADLINE_S": 90,
    "GPUAAS_TASK_DEADLINE_GRACE_S": 5,
    "GPUAAS_TASK_DEADLINE_SWEEP_INTERVAL_S": 2,
    "GPUAAS_TASK_REASK_WAIT_S": 10,
    "GPUAAS_MAAS_REASK_AFTER_S": 10,
    # a deployed host that never enrols fails its allocation after 60 s (default 30 min).
    "GPUAAS_ENROLMENT_DEADLINE_S": 60,
    # scheduler: the claim audit runs every 2 s (default 30 s), asks about each allocation's claims every 10 s
    # (default 5 min) once they and the allocator's end are 20 s old (default 60 s), and frees the claims of an
    # allocation the allocator does not know after 90 s (default 15 min).
    "GPUAAS_CLAIM_AUDIT_SWEEP_INTERVAL_S": 2,
    "GPUAAS_CLAIM_AUDIT_EVERY_S": 10,
    "GPUAAS_CLAIM_AUDIT_MIN_AGE_S": 20,
    "GPUAAS_CLAIM_ORPHAN_AFTER_S": 90,
    # gateway: a MAAS call times out after 3 s (default 10 s), an operation after 180 s (default 30 min), the
    # breaker cools down in 2 s (default 10 s); Retry-After capped at 2 s (default 120 s).
    "maas-gateway": {
        "GPUAAS_MAAS_TIMEOUT_S": 3,
        "GPUAAS_MAAS_DEADLINE_S": 180,
        "GPUAAS_MAAS_BREAKER_COOLDOWN_S": 2,
        "GPUAAS_MAAS_RETRY_AFTER_CAP_S": 2,
    },
}
# The simulated MAAS machine moves through deploying and releasing in about a second each.
CHAOS_MAAS_TIMERS = {"deploying": 1.0, "releasing": 0.5, "disk_erasing": 0.5}

REPLICATED = ("allocator", "scheduler", "image-pipeline", "maas-gateway")
# `nats` crashes a server (SIGKILL): its Raft groups elect new leaders only after nats-server's election timeout
# (4-9 s, constants in server/raft.go). `nats_stop` stops one the way a rolling upgrade does (SIGTERM: the server
# steps down every Raft leader it holds before it exits) and starts it again.
FAULT_KINDS = ("kill", "pause", "nats", "nats_stop", "pg_fast", "pg_immediate", "pg_async_immediate", "maas")
TRANSIENT = (A.REQUESTED, A.ACCEPTED, A.PLACED, A.PROVISIONING, A.RELEASING)
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDev tenant@example"


@dataclass
class ChaosPlan:
    seed: int = 1
    allocations: int = 1000
    baremetal_share: float = 0.08
    # Portal clients working at once, each: request, wait until active, hold, release, wait until ended.
    clients: int = 10
    hold_s: tuple[float, float] = (0.2, 3.0)
    # Allocations left active for the checker's look at running VMs and deployed machines.
    keep_active: int = 4
    # Pause between one fault healed and the next injected.
    fault_gap_s: tuple[float, float] = (1.0, 4.0)
    # Each kind of fault once first (in a seeded order), then drawn by weight.
    weights: dict[str, float] = field(
        default_factory=lambda: {
            "kill": 4,
            "pause": 3,
            "nats": 2,
            "nats_stop": 1,
            "pg_fast": 1,
            "pg_immediate": 1,
            "maas": 3,
        }
    )
    wait_state_s: float = 300.0
    # A portal that sees no answer asks again after this long: a request while the allocator has no record of
    # it, a release while it still says active. A database that lost acknowledged commits (synchronous_commit
    # off) may have lost either after the message was consumed.
    release_again_s: float = 30.0
    converge_s: float = 600.0
    # Once settled, how long the checker lets background repairs (the scheduler's claim audit, whose rounds are
    # tens of seconds apart) clear what they exist to clear before a violation counts. The report says how long
    # it took; the claim history (no double booking, ever) cannot be repaired by waiting.
    repair_s: float = 120.0


@dataclass
class FaultRecord:
    kind: str
    target: str
    at: float  # wall clock (the database's timeline uses the same clock)
    healed_at: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    in_flight: int = 0
    moves_again_s: float | None = None
    slowest_in_flight_s: float | None = None


class Portal:
    """Publishes like a portal: given every seed URL, retrying a publish that timed out with the same
    Nats-Msg-Id so JetStream keeps one copy."""

    def __init__(self, nc: NatsClient, spy: BusSpy) -> None:
        self.nc, self.js, self.spy = nc, nc.jetstream(), spy
        self.retries = 0
        self.releases_again = 0
        self.requests_again = 0

    async def publish(self, subject: str, type_: str, payload: m.Payload, alloc: str) -> None:
        env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="portal", correlation_id=alloc)
        body, msg_id = env.model_dump_json().encode(), env.event_id
        deadline = time.monotonic() + 120
        while True:
            try:
                await self.js.publish(subject, body, headers={"Nats-Msg-Id": msg_id}, timeout=5)
                return
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.js.errors.NoStreamResponseError,
                nats.js.errors.APIError,
            ) as exc:
                # No stream answered: a NATS server is down and the stream is electing a leader.
                if time.monotonic() > deadline:
                    raise TimeoutError(f"publish of {type_} {alloc} kept failing: {exc!r}") from None
                self.retries += 1
                await asyncio.sleep(0.5)

    async def request(self, alloc: str, shape: str) -> None:
        slice_ = shape == Shape.GPU_SLICE
        payload = m.AllocationRequested(
            allocation_id=uuid.UUID(alloc),
            tenant_id="tenant-chaos",
            shape=shape,  # type: ignore[arg-type]
            sku="h200-sxm-slice" if slice_ else "h200-sxm",
            gpu_count=1 if slice_ else 8,
            image="ubuntu-24.04-h200-slice" if slice_ else "ubuntu-24.04-h200-host",
            ssh_public_keys=[SSH_KEY],
        )
        await self.publish("gpuaas.allocation.requested", "allocation.requested", payload, alloc)

    async def release(self, alloc: str) -> None:
        payload = m.AllocationReleaseRequested(allocation_id=uuid.UUID(alloc), reason="chaos workload")
        await self.publish("gpuaas.allocation.release_requested", "allocation.release_requested", payload, alloc)


class States:
    """The allocator's view of every allocation of the run, polled from its table (through Postgres restarts)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.state: dict[str, str] = {}
        self.changed = asyncio.Event()
        self._conn: asyncpg.Connection | None = None
        self.poll_errors = 0

    async def poll_forever(self, ids: list[str], interval_s: float = 0.3) -> None:
        while True:
            try:
                if self._conn is None or self._conn.is_closed():
                    self._conn = await asyncpg.connect(self.dsn, timeout=5)
                rows = await self._conn.fetch(
                    "SELECT allocation_id::text AS id, state FROM allocator.allocations "
                    "WHERE allocation_id = ANY($1::uuid[])",
                    ids,
                    # A query caught by a Postgres crash or a paused process can wait for good on its socket; a
                    # poller stuck on one made every client wait out wait_state_s (a 15-minute run of 40).
                    timeout=5,
                )
                new = {r["id"]: r["state"] for r in rows}
                if new != self.state:
                    self.state = new
                    self.changed.set()
            except Exception:  # noqa: BLE001 - the observer must outlive anything a crashing database throws
                # (InternalClientError "cannot switch to state" once killed it, and every client waited 300 s).
                self.poll_errors += 1
                if self._conn is not None and not self._conn.is_closed():
                    self._conn.terminate()
                self._conn = None
            await asyncio.sleep(interval_s)

    async def wait(self, alloc: str, wanted: tuple[str, ...], timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while (state := self.state.get(alloc)) not in wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=min(remaining, 1.0))
            except TimeoutError:
                pass
        return state

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.terminate()


class Workload:
    def __init__(self, plan: ChaosPlan, portal: Portal, states: States, rng: random.Random) -> None:
        self.plan, self.portal, self.states = plan, portal, states
        n = plan.allocations
        bare = set(rng.sample(range(n), round(n * plan.baremetal_share)))
        self.items = [(str(uuid.UUID(int=rng.getrandbits(128), version=4)), i in bare) for i in range(n)]
        self.holds = [rng.uniform(*plan.hold_s) for _ in range(n)]
        self.keep = {alloc for alloc, _ in self.items[-plan.keep_active :]} if plan.keep_active else set()
        self.outcomes: Counter[str] = Counter()
        self.stuck: list[str] = []
        self._next = 0
        self.done = False

    @property
    def issued_all(self) -> bool:
        return self.done or self._next >= len(self.items)

    @property
    def ids(self) -> list[str]:
        return [alloc for alloc, _ in self.items]

    async def run(self) -> None:
        await asyncio.gather(*(self._client() for _ in range(self.plan.clients)))
        self.done = True

    async def _client(self) -> None:
        while self._next < len(self.items):
            index = self._next
            self._next += 1
            alloc, baremetal = self.items[index]
            first = await request_until_seen(self.portal, self.states, alloc, baremetal, self.plan)
            if first is None:
                self.stuck.append(alloc)
                self.outcomes["stuck_before_active"] += 1
                continue
            self.outcomes[first] += 1
            if first != "active" or alloc in self.keep:
                continue
            # The tenant uses it for a while: workload think time, not a wait for the system.
            await asyncio.sleep(self.holds[index])
            end = await release_until_ended(self.portal, self.states, alloc, self.plan)
            if end is None:
                self.stuck.append(alloc)
                self.outcomes["stuck_releasing"] += 1


async def _ask_until(
    ask: Callable[[], Awaitable[None]],
    states: States,
    alloc: str,
    wanted: tuple[str, ...],
    unheard: Callable[[str | None], bool],
    plan: ChaosPlan,
) -> tuple[str | None, int]:
    """Ask, and wait for one of `wanted`; ask again every `release_again_s` while the allocator's state says the
    asking went unheard (its commit lost with acknowledged commits), as a portal does. The end state (None when
    `wait_state_s` ran out) and how often it asked again."""
    await ask()
    again = 0
    deadline = time.monotonic() + plan.wait_state_s
    while (left := deadline - time.monotonic()) > 0:
        state = await states.wait(alloc, wanted, min(left, plan.release_again_s))
        if state is not None:
            return state, again
        if unheard(states.state.get(alloc)):
            again += 1
            await ask()
    return None, again


async def request_until_seen(
    portal: Portal, states: States, alloc: str, baremetal: bool, plan: ChaosPlan
) -> str | None:
    """Active or ended, asked again while the allocator has no record of it at all."""
    shape = Shape.BAREMETAL if baremetal else Shape.GPU_SLICE
    state, again = await _ask_until(
        lambda: portal.request(alloc, shape), states, alloc, ("active", *TERMINAL), lambda s: s is None, plan
    )
    portal.requests_again += again
    return state


async def release_until_ended(portal: Portal, states: States, alloc: str, plan: ChaosPlan) -> str | None:
    """Ended, asked again while the allocator still says active."""
    state, again = await _ask_until(
        lambda: portal.release(alloc), states, alloc, TERMINAL, lambda s: s == "active", plan
    )
    portal.releases_again += again
    return state


class Supervisor:
    """What compose's `restart: unless-stopped` does in production: a process that exits without being asked
    to is started again. Exits the injector did not cause are counted (with the last line the process logged)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.planned: set[str] = set()  # killed by the injector, which restarts them itself
        self.unplanned: list[dict[str, Any]] = []

    async def run(self, interval_s: float = 0.5) -> None:
        while True:
            for name in self.stack.crashed():
                if name in self.planned:
                    continue
                last = self.stack.log_tail(name, 1)
                self.unplanned.append({"process": name, "at": time.time(), "last_log_line": last[-400:]})
                try:
                    await asyncio.to_thread(self.stack.restart, name)
                except Exception as exc:  # noqa: BLE001 - retried on the next round, and reported
                    self.unplanned[-1]["restart_error"] = f"{type(exc).__name__}: {exc}"[:300]
            await asyncio.sleep(interval_s)


class Injector:
    """Seeded faults, one at a time; every one is healed before the next (a killed replica restarted, a paused
    process continued, the NATS server started again), so the run measures recovery, not permanent loss."""

    def __init__(
        self, stack: Stack, plan: ChaosPlan, rng: random.Random, states: States, supervisor: Supervisor
    ) -> None:
        self.stack, self.plan, self.rng, self.states, self.supervisor = stack, plan, rng, states, supervisor
        self.records: list[FaultRecord] = []
        self.errors: list[str] = []

    def _tour(self) -> list[str]:
        kinds = [k for k in FAULT_KINDS if k == "pg_async_immediate" or self.plan.weights.get(k)]
        self.rng.shuffle(kinds)
        return kinds

    def _draw(self) -> str:
        kinds = sorted(self.plan.weights)
        return self.rng.choices(kinds, weights=[self.plan.weights[k] for k in kinds])[0]

    async def run(self, workload: Workload) -> None:
        tour = self._tour()
        # Every kind once even when the workload is short; then drawn while the workload still sends requests
        # (faults after that would be measured against a pipeline with nothing left to move).
        while tour or not workload.issued_all:
            kind = tour.pop(0) if tour else self._draw()
            try:
                await self._inject(kind)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}"[:500])
            # The injector's pacing between faults (a schedule, not a wait for the system).
            await asyncio.sleep(self.rng.uniform(*self.plan.fault_gap_s))

    def _record(self, kind: str, target: str, **detail: Any) -> FaultRecord:
        in_flight = sum(1 for s in self.states.state.values() if s in TRANSIENT)
        rec = FaultRecord(kind, target, time.time(), detail=detail, in_flight=in_flight)
        self.records.append(rec)
        return rec

    async def _inject(self, kind: str) -> None:
        stack, rng = self.stack, self.rng
        if kind == "kill":
            target = rng.choice([n for s in REPLICATED for n in stack.replica_names(s)])
            down = rng.uniform(0.5, 3.0)
            rec = self._record(kind, target, down_s=round(down, 2))
            self.supervisor.planned.add(target)
            try:
                stack.kill(target, signal.SIGKILL)
                await asyncio.sleep(down)
                await asyncio.to_thread(stack.restart, target)
            finally:
                self.supervisor.planned.discard(target)
        elif kind == "pause":
            target = rng.choice([*(n for s in REPLICATED for n in stack.replica_names(s)), "node-agent", "maas-sim"])
            paused = rng.uniform(1.0, 8.0)  # past the 5 s ack wait sometimes: redelivered to the other replica
            rec = self._record(kind, target, paused_s=round(paused, 2))
            stack.kill(target, signal.SIGSTOP)
            try:
                await asyncio.sleep(paused)
            finally:
                stack.kill(target, signal.SIGCONT)
        elif kind in ("nats", "nats_stop"):
            server = rng.choice(stack.nats_servers)
            down = rng.uniform(2.0, 6.0)
            rec = self._record(kind, server.server_name or "nats", down_s=round(down, 2))
            if kind == "nats":
                server.kill()
            else:
                await asyncio.to_thread(server.stop)
            await asyncio.sleep(down)
            await asyncio.to_thread(server.start, 60.0)
        elif kind in ("pg_fast", "pg_immediate"):
            mode = kind.removeprefix("pg_")
            rec = self._record(kind, "postgres", mode=mode)
            await asyncio.to_thread(stack.restart_postgres, mode)
        elif kind == "pg_async_immediate":
            # Come back acknowledging commits before they are flushed, let the pipeline commit for a few
            # seconds, then crash it: the last commits are lost, after their events may have gone out.
            await asyncio.to_thread(stack.restart_postgres, "fast", synchronous_commit=False)
            await asyncio.sleep(rng.uniform(2.0, 5.0))
            rec = self._record(kind, "postgres", mode="immediate", synchronous_commit="off")
            await asyncio.to_thread(stack.restart_postgres, "immediate", synchronous_commit=True)
        elif kind == "maas":
            fault = self._maas_fault()
            rec = self._record(kind, "maas-sim", fault=fault)
            await sim_request(stack, "POST", "/_sim/faults", fault)
        else:
            raise ValueError(f"unknown fault kind {kind}")
        rec.healed_at = time.time()

    def _maas_fault(self) -> dict[str, Any]:
        rng = self.rng
        op = rng.choice(["deploy", "release", "read", "list", "*"])
        count = rng.randint(1, 3)
        shape = rng.choice(["timeout", "hold", "close", "gateway_timeout", "server_error", "unavailable", "failed"])
        if shape == "timeout":  # slower than the gateway's 3 s timeout, committed meanwhile
            return {"kind": "latency", "op": op, "count": count, "latency": 4.0, "commit": True}
        if shape in ("hold", "close"):  # committed, then the answer never comes (held open) or the socket drops
            return {"kind": "lost_after_commit", "op": op, "count": count, "mode": shape, "hold_seconds": 8.0}
        if shape == "unavailable":
            return {"kind": "unavailable", "op": op, "count": count, "retry_after": 1}
        if shape == "failed":
            return {"kind": "failed_deployment", "op": "deploy", "count": 1}
        return {"kind": shape, "op": op, "count": count}


async def sim_request(stack: Stack, method: str, path: str, body: Any = None) -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        # The simulator's HTTPS is verified against the stack's CA alone.
        tls = stack.maas_ssl_context or True
        async with http.request(method, f"{stack.maas_base_url}{path}", json=body, ssl=tls) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise RuntimeError(f"{method} {path}: {resp.status} {text[:200]}")
            return json.loads(text)


async def fleet_hosts(stack: Stack) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.get(f"{stack.fleet_sim_url}/sim/hosts") as resp:
            resp.raise_for_status()
            return dict(await resp.json())


async def heal(stack: Stack) -> None:
    """Everything back: every process running (the supervisor restarts them), every NATS server running and
    current, no MAAS faults left."""
    with contextlib.suppress(TimeoutError):
        await eventually(lambda: not stack.crashed(), timeout=120, interval=0.5, what="every process running")
    for server in stack.nats_servers:
        if not server.alive():
            await asyncio.to_thread(server.start, 60.0)
    for server in stack.nats_servers:
        await asyncio.to_thread(server.wait_healthy, 60.0)
    await sim_request(stack, "DELETE", "/_sim/faults")


async def recovery_times(dsn: str, records: list[FaultRecord], ids: list[str]) -> None:
    """Per fault, from the allocator's timeline (same clock): `moves_again_s`, from the fault until any
    allocation of the run reaches a new state; `slowest_in_flight_s`, until the last allocation that was in
    a transient state at the fault made its next step (includes ordinary work such as provisioning)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT allocation_id::text AS id, state, extract(epoch FROM at) AS at FROM allocator.allocation_timeline "
            "WHERE allocation_id = ANY($1::uuid[]) ORDER BY at",
            ids,
        )
    finally:
        await conn.close()
    times = [float(r["at"]) for r in rows]
    by_alloc: dict[str, list[tuple[float, str]]] = {}
    for r in rows:
        by_alloc.setdefault(r["id"], []).append((float(r["at"]), r["state"]))
    for rec in records:
        after = next((t for t in times if t > rec.at), None)
        rec.moves_again_s = round(after - rec.at, 3) if after is not None else None
        slowest = None
        for steps in by_alloc.values():
            before = [s for t, s in steps if t <= rec.at]
            if not before or before[-1] not in TRANSIENT:
                continue
            nxt = next((t for t, _ in steps if t > rec.at), None)
            if nxt is not None:
                slowest = max(slowest or 0.0, nxt - rec.at)
        rec.slowest_in_flight_s = round(slowest, 3) if slowest is not None else None


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))]
    return {
        "n": len(ordered),
        "p50": round(statistics.median(ordered), 3),
        "p99": round(p99, 3),
        "max": round(ordered[-1], 3),
    }


async def check(stack: Stack, conn: ServiceDatabases, requested: list[str]) -> dict[str, list[str]]:
    """The independent checker at a quiet moment: databases, simulated hosts and MAAS simulator."""
    allocations, claims = await allocations_and_claims(conn)
    bare = {n.maas_system_id for n in stack.fleet.nodes if n.kind == "baremetal" and n.maas_system_id}
    machines = (await sim_request(stack, "GET", "/_sim/machines"))["machines"]
    return {
        "lifecycle": lifecycle_violations(requested, allocations),
        "database": await database_violations(conn),
        "hosts": host_violations(allocations, claims, await fleet_hosts(stack)),
        "maas": maas_violations(allocations, machines, bare),
    }


async def check_repaired(
    stack: Stack, conn: ServiceDatabases, requested: list[str], within_s: float
) -> tuple[dict[str, list[str]], float]:
    """The checker's findings once background repairs had up to `within_s` to clear them, and how long that took
    (0 when there was nothing to clear)."""
    started = time.monotonic()
    found: dict[str, list[str]] = {}

    async def clear() -> bool:
        nonlocal found
        found = await check(stack, conn, requested)
        return not any(found.values())

    # The audit's rounds are seconds apart: look again at that pace.
    with contextlib.suppress(TimeoutError):
        await eventually(clear, timeout=within_s, interval=2.0, what="repairs")
    return found, round(time.monotonic() - started, 1)


_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


async def violating_timelines(conn: ServiceDatabases, violations: dict[str, list[str]]) -> dict[str, list[str]]:
    """The allocator's timeline of every allocation a violation names, to read a failed run without re-running it
    (the faults are seeded, their timing is not)."""
    ids = sorted({m for found in violations.values() for v in found for m in _UUID_RE.findall(v)})
    rows = await conn.fetch(
        "SELECT allocation_id::text AS id, seq, state, reason_code, to_char(at, 'HH24:MI:SS.MS') AS at "
        "FROM allocator.allocation_timeline WHERE allocation_id = ANY($1::uuid[]) ORDER BY allocation_id, seq",
        ids,
    )
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r["id"], []).append(
            f"{r['at']} {r['seq']}:{r['state']}" + (f" ({r['reason_code']})" if r["reason_code"] else "")
        )
    return out


async def _settle(stack: Stack, js: Any, states: States, ids: list[str], timeout_s: float) -> dict[str, Any]:
    """Wait until every allocation is active or ended, every durable drained and every outbox empty."""
    started = time.monotonic()
    deadline = started + timeout_s
    settled = ("active", *TERMINAL)
    with contextlib.suppress(TimeoutError):
        await eventually(
            lambda: all(states.state.get(a) in settled for a in ids), timeout=timeout_s, interval=0.5, what="settled"
        )
    nodes = [n.node_id for n in stack.fleet.nodes if n.kind == "slice_host"]
    durables = [(c.stream, c.durable) for c in CONSUMERS] + [
        (c.stream, c.durable) for c in (node_agent_consumer(n) for n in nodes)
    ]
    figures = await wait_consumers_drained(js, durables, timeout_s=max(10.0, deadline - time.monotonic()))
    async with await stack.open_databases() as dbs:
        await wait_outboxes_empty(dbs, timeout_s=max(5.0, deadline - time.monotonic()))
    return {
        "settle_s": round(time.monotonic() - started, 2),
        "undrained_consumers": {d: f for d, f in figures.items() if any(f.values())},
    }


async def run_chaos(stack: Stack, plan: ChaosPlan) -> dict[str, Any]:
    rng = random.Random(plan.seed)
    spy = await BusSpy(stack.nats_url, connect=stack.nats_options("admin")).start()
    portal_nc = await nats.connect(**stack.nats_options("portal"), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    admin_nc = await nats.connect(**stack.nats_options("admin"), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = admin_nc.jetstream()
    dlq_before = (await js.stream_info("DLQ")).state.last_seq
    states = States(stack.dsn_for("allocator"))
    portal = Portal(portal_nc, spy)
    workload = Workload(plan, portal, states, rng)
    supervisor = Supervisor(stack)
    injector = Injector(stack, plan, random.Random(rng.getrandbits(64)), states, supervisor)
    poller = asyncio.create_task(states.poll_forever(workload.ids))
    supervising = asyncio.create_task(supervisor.run())
    started = time.monotonic()
    report: dict[str, Any] = {"seed": plan.seed, "plan": asdict(plan)}
    try:
        await asyncio.gather(workload.run(), injector.run(workload))
        report["workload_s"] = round(time.monotonic() - started, 1)
        await heal(stack)
        ids = workload.ids
        report["settle_with_active"] = await _settle(stack, js, states, ids, plan.converge_s)
        conn = await stack.open_databases()
        try:
            report["violations_with_active"], report["repaired_with_active_s"] = await check_repaired(
                stack, conn, ids, plan.repair_s
            )
            report["violating_timelines"] = await violating_timelines(conn, report["violations_with_active"])
            active = [a for a in ids if states.state.get(a) == "active"]
            report["active_at_first_check"] = len(active)
            await asyncio.gather(*(release_until_ended(portal, states, alloc, plan) for alloc in active))
            report["settle_released"] = await _settle(stack, js, states, ids, plan.converge_s)
            report["violations_at_end"], report["repaired_at_end_s"] = await check_repaired(
                stack, conn, ids, plan.repair_s
            )
            # Claims the scheduler's audit freed because their end never reached it (a lost commit).
            report["claims_settled_by_audit"] = await conn.fetchval(
                "SELECT count(DISTINCT allocation_id) FROM scheduler.slot_transitions WHERE actor = 'claim-audit'"
            )
            report["violating_timelines"] |= await violating_timelines(conn, report["violations_at_end"])
            final = Counter(states.state.get(a, "missing") for a in ids)
            report["still_active_at_end"] = [a for a in ids if states.state.get(a) == "active"]
        finally:
            await conn.close()
        letters, problems = await dead_letters(js, after_seq=dlq_before)
        await recovery_times(stack.dsn_for("allocator"), injector.records, ids)
    finally:
        poller.cancel()
        supervising.cancel()
        await asyncio.gather(poller, supervising, return_exceptions=True)
        await states.close()
        await portal_nc.drain()
        await admin_nc.drain()
        await spy.stop()
    by_kind: dict[str, list[float]] = {}
    for rec in injector.records:
        # Only faults that met work in flight: with nothing to move, "moves again" measures the workload.
        if rec.moves_again_s is not None and rec.in_flight:
            by_kind.setdefault(rec.kind, []).append(rec.moves_again_s)
    report.update(
        {
            "allocations": len(workload.items),
            "baremetal": sum(1 for _, b in workload.items if b),
            "first_outcome": dict(workload.outcomes),
            "final_states": dict(final),
            "stuck_during_workload": workload.stuck,
            "faults": dict(Counter(r.kind for r in injector.records)),
            "fault_errors": injector.errors,
            "recovery_moves_again_s": {"all": _percentiles([v for vs in by_kind.values() for v in vs])}
            | {k: _percentiles(v) for k, v in sorted(by_kind.items())},
            "recovery_slowest_in_flight_s": _percentiles(
                [r.slowest_in_flight_s for r in injector.records if r.slowest_in_flight_s is not None and r.in_flight]
            ),
            "fault_log": [asdict(r) for r in injector.records],
            "crashed_processes": stack.crashed(),
            "unplanned_exits": dict(Counter(x["process"] for x in supervisor.unplanned)),
            "unplanned_exit_log": supervisor.unplanned[:30],
            "dead_letters": len(letters),
            "dead_letters_by_reason": dict(Counter(str(x["reason_code"]) for x in letters)),
            "dlq_problems": problems,
            "portal_publish_retries": portal.retries,
            "portal_releases_asked_again": portal.releases_again,
            "portal_requests_asked_again": portal.requests_again,
            "state_poll_errors": states.poll_errors,
            "contract_violations": spy.violations[:20],
            "bus_messages_seen": len(spy.messages),
        }
    )
    report["ok"] = ok(report)
    return report


def ok(report: dict[str, Any]) -> bool:
    """The pass condition: every invariant holds at both checks, nothing undrained, no bad dead letter,
    nothing crashed, no contract violation, no allocation left active after the final releases."""
    return not (
        any(report["violations_with_active"].values())
        or any(report["violations_at_end"].values())
        or report["settle_with_active"]["undrained_consumers"]
        or report["settle_released"]["undrained_consumers"]
        or report["dlq_problems"]
        or report["crashed_processes"]
        or report["contract_violations"]
        or report["still_active_at_end"]
    )
