"""Cost and latency of the control plane: a sweep of offered load on instant simulated hosts, with Postgres
durable (fsync and synchronous_commit on), and the outbox relay's throughput next to raw JetStream.

Per offered load (allocations/s) it reports requested -> active p50/p99, the share that went active, and the
CPU milliseconds each process of the stack spent per allocation (allocate + release cycle), read from
/proc/<pid>/stat (utime+stime of the process and every live descendant, plus what reaped children left in
cutime+cstime: Postgres is its whole process tree, backends included) before and after the measured window.
The window runs from the first request until every cycle has ended, every durable consumer has drained and
every outbox is empty. Idle CPU per second (same processes, no load) is measured before each point.

Baselines from the same stack, right before each point (the machine is noisy: read ratios):
- raw JetStream: publish with PubAck -> durable pull consumer -> ack, at the point's rate (latency and
  nats-server CPU per message);
- raw Postgres: one durable INSERT commit after another (latency, commits/s).

    .venv/bin/python bench/pipeline.py --json                          # 10, 50, 100, 200 allocations/s
    .venv/bin/python bench/pipeline.py --rates 50 --duration 20 --json
    .venv/bin/python bench/pipeline.py --nats-cluster 3 --json         # the same sweep on a 3-server cluster
    .venv/bin/python bench/pipeline.py --full-rate 5 --open-bus --json # plus full simulated hosts, open bus

Not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import CONSUMERS, node_agent_consumer
from gpuaas_common.logging import configure_logging
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.outbox import OutboxRelay, OutboxWriter
from gpuaas_dev.stack import Stack, StackError
from gpuaas_dev.testing.databases import ServiceDatabases
from gpuaas_dev.testing.invariants import outbox_backlog
from gpuaas_scheduler.adapters import inventory as inv

CONTROL_PLANE = ("allocator", "scheduler", "image-pipeline", "maas-gateway")
TERMINAL = ("allocation.failed", "allocation.unschedulable", "allocation.rejected")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --- CPU accounting from /proc ------------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, utime+stime, cutime+cstime: what the children it reaped spent)."""
    table: dict[int, tuple[int, int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                text = f.read().decode()
        except OSError:
            continue  # exited meanwhile: its time is in its parent's cutime once reaped
        fields = text[text.rindex(")") + 2 :].split()
        # fields[0] is state (field 3); ppid is field 4, utime, stime, cutime, cstime fields 14..17.
        table[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]))
    return table


def tree_ticks(table: dict[int, tuple[int, int, int]], root: int) -> int:
    """CPU ticks of `root` and all its live descendants, including the children they reaped. A child that
    exits during the window moves from the live sum to its parent's cutime, so deltas stay right."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            total += table[pid][1] + table[pid][2]
            todo.extend(children.get(pid, ()))
    return total


def _pid_or_none(stack: Stack, name: str) -> int | None:
    try:
        return stack.pid(name)
    except StackError:  # a stack that does not run it (the authority only runs where identities are on)
        return None


def stack_pids(stack: Stack) -> dict[str, list[int]]:
    """Root pid(s) of every process the stack runs, by the name the report uses."""
    pids: dict[str, list[int]] = {}
    # ops-view (the read models) and the credential authority are not on an allocation's path, so not in
    # CONTROL_PLANE; they share the machine, so their CPU is reported beside it.
    for name in (
        "allocator",
        "scheduler",
        "image-pipeline",
        "maas-gateway",
        "node-agent",
        "maas-sim",
        "ops-view",
        "credential-authority",
    ):
        # Every replica of a service counts to it (allocator, allocator-2, ...).
        single = name in ("maas-sim", "credential-authority") or not hasattr(stack, "replica_names")
        names = [name] if single else stack.replica_names(name)
        found = [pid for n in names if (pid := _pid_or_none(stack, n)) and stack.is_running(n)]
        if found:
            pids["sim-fleet" if name == "node-agent" else name] = found
    nats_obj = stack._nats  # noqa: SLF001 - the bench reads the server processes the stack started
    servers = getattr(nats_obj, "servers", None) or [nats_obj]
    pids["nats-server"] = [s.proc.pid for s in servers if getattr(s, "proc", None) is not None]
    pg = stack._pg  # noqa: SLF001
    pgdata = getattr(pg, "_pgdata", None)
    if pgdata is not None:
        try:
            pids["postgres"] = [int(Path(pgdata, "postmaster.pid").read_text().split()[0])]
        except (OSError, ValueError, IndexError):
            pass
    pids["bench-client"] = [os.getpid()]
    return pids


def cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, float]:
    table = _proc_table()
    out = {name: sum(tree_ticks(table, p) for p in roots) * 1000.0 / CLK_TCK for name, roots in pids.items()}
    # The bench spawned the services and NATS: its tree is the whole stack. Its own share is its process alone.
    me = table.get(os.getpid())
    out["bench-client"] = (me[1] if me else 0) * 1000.0 / CLK_TCK
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


# --- baselines ------------------------------------------------------------------------------------------


async def raw_jetstream(
    stack: Stack, pids: dict[str, list[int]], rate: float, count: int, idle: dict[str, float]
) -> dict:
    """Publish (PubAck) -> durable pull consumer -> ack, on a file stream of its own, at `rate`: one hop of
    the pipeline with nothing of ours in it."""
    nc = await nats.connect(**stack.nats_options("admin"))
    js = nc.jetstream()
    stream = f"BENCHRAW{uuid.uuid4().hex[:8].upper()}"
    subject = f"gpuaas.benchraw.{stream.lower()}"
    replicas = getattr(stack, "nats_cluster", None) or 1
    await js.add_stream(
        StreamConfig(name=stream, subjects=[subject], storage=StorageType.FILE, num_replicas=int(replicas))
    )
    await js.add_consumer(stream, ConsumerConfig(durable_name="raw", ack_policy=AckPolicy.EXPLICIT))
    sub = await js.pull_subscribe_bind("raw", stream=stream)
    sent: dict[str, float] = {}
    lat: list[float] = []
    body = b"x" * 600  # about an envelope's size

    async def consume() -> None:
        while len(lat) < count:
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                await msg.ack()
                lat.append((time.perf_counter() - sent[msg.headers["Nats-Msg-Id"]]) * 1000)

    consumer = asyncio.create_task(consume())
    before = cpu_snapshot(pids)
    start = time.perf_counter()
    for i in range(count):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        msg_id = f"raw-{i}"
        sent[msg_id] = time.perf_counter()
        await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id})
    await asyncio.wait_for(consumer, timeout=60)
    cpu = cpu_delta(before, cpu_snapshot(pids))
    elapsed = time.perf_counter() - start
    await js.delete_stream(stream)
    await nc.drain()
    return {
        "messages": count,
        "p50_ms": round(pct(lat, 0.5), 2),
        "p99_ms": round(pct(lat, 0.99), 2),
        # Net of what the servers burn idle (a cluster with hundreds of durables burns a lot).
        "nats_server_cpu_ms_per_msg": round(max(0.0, cpu["nats-server"] - idle["nats-server"] * elapsed) / count, 3),
    }


async def raw_postgres(stack: Stack, seconds: float) -> dict:
    """Durable single-row INSERT commits, one after another: the floor under every unit of work."""
    conn = await asyncpg.connect(stack.admin_dsn)
    await conn.execute("CREATE TABLE IF NOT EXISTS public.bench_commit (id bigserial, body bytea)")
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        s = time.perf_counter()
        await conn.execute("INSERT INTO public.bench_commit (body) VALUES ($1)", b"x" * 600)
        lat.append((time.perf_counter() - s) * 1000)
    await conn.execute("DROP TABLE public.bench_commit")
    await conn.close()
    return {
        "commits_per_s": round(len(lat) / seconds),
        "p50_ms": round(pct(lat, 0.5), 3),
        "p99_ms": round(pct(lat, 0.99), 3),
    }


# --- the load -------------------------------------------------------------------------------------------


@dataclass
class Cycles:
    sent: dict[str, float] = field(default_factory=dict)
    active: dict[str, float] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    total_sent: bool = False

    def check(self) -> None:
        if self.total_sent and len(self.released) + len(self.failed) >= len(self.sent):
            self.done.set()


async def settle(js: Any, db: ServiceDatabases, timeout_s: float, skip: frozenset[str] = frozenset()) -> dict:
    """Every durable drained and every outbox empty: nothing of the last load is still being worked on. One
    CONSUMER.LIST per stream and round (not one request per durable: the fleet has hundreds), so that the
    bench's own polling stays a small part of what it measures. Consumers named in `skip` are not waited on
    (bench/hostile_host.py: those a flood keeps busy for as long as it lasts)."""
    streams = sorted({c.stream for c in CONSUMERS} | {node_agent_consumer("x").stream})
    deadline = time.monotonic() + timeout_s
    while True:
        busy: dict[str, dict[str, int]] = {}
        for stream in streams:
            offset = 0
            while True:
                infos = await js.consumers_info(stream, offset=offset or None)
                for info in infos:
                    pending, unacked = info.num_pending or 0, info.num_ack_pending or 0
                    if (pending or unacked) and info.name not in skip:
                        busy[info.name] = {"pending": pending, "ack_pending": unacked}
                if len(infos) < 256:
                    break
                offset += len(infos)
        backlog = {k: v for k, v in (await outbox_backlog(db)).items() if v}
        if (not busy and not backlog) or time.monotonic() >= deadline:
            return {"undrained": busy, "outbox": backlog}
        await asyncio.sleep(0.25)


async def sweep_point(
    stack: Stack,
    pids: dict[str, list[int]],
    rate: float,
    duration: float,
    gpus: int,
    idle_s: float,
    settle_skip: frozenset[str] = frozenset(),
    keep_latencies: bool = False,
) -> dict:
    nc = await nats.connect(**stack.nats_options("portal"))
    js = nc.jetstream()
    admin = await nats.connect(**stack.nats_options("admin"))
    admin_js = admin.jetstream()
    db = await stack.open_databases()
    total = max(1, int(rate * duration))

    # Idle: what the stack burns with no load (heartbeats, pollers, fetch loops); charged to no allocation.
    await settle(admin_js, db, 120, settle_skip)
    before = cpu_snapshot(pids)
    await asyncio.sleep(idle_s)
    idle = {k: v / idle_s for k, v in cpu_delta(before, cpu_snapshot(pids)).items()}

    raw_js = await raw_jetstream(stack, pids, rate, max(50, min(total, int(rate * 3))), idle)
    raw_pg = await raw_postgres(stack, 1.0)
    await settle(admin_js, db, 60, settle_skip)

    c = Cycles()

    async def release(alloc: str) -> None:
        body = m.AllocationReleaseRequested(allocation_id=uuid.UUID(alloc), reason="bench")
        env = Envelope.wrap(
            "allocation.release_requested", body.model_dump(mode="json"), producer="bench", correlation_id=alloc
        )
        await js.publish(
            "gpuaas.allocation.release_requested", env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id}
        )

    async def on_event(msg: Any) -> None:
        data = json.loads(msg.data)
        alloc = data["payload"].get("allocation_id")
        if alloc not in c.sent:
            return
        kind = data["type"]
        if kind == "allocation.active" and alloc not in c.active:
            c.active[alloc] = time.perf_counter()
            await release(alloc)
        elif kind == "allocation.released":
            c.released.add(alloc)
        elif kind in TERMINAL:
            c.failed[alloc] = data["payload"].get("reason_code") or kind
        c.check()

    await nc.subscribe("gpuaas.allocation.event.>", cb=on_event)
    before = cpu_snapshot(pids)
    t0 = time.perf_counter()
    for i in range(total):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        alloc = str(uuid.uuid4())
        req = m.AllocationRequested(
            allocation_id=uuid.UUID(alloc),
            tenant_id="bench",
            shape="gpu_slice",
            sku="h200-sxm-slice",
            gpu_count=gpus,
            image="ubuntu-24.04-h200-slice",
            ssh_public_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBench bench@gpuaas"],
        )
        env = Envelope.wrap("allocation.requested", req.model_dump(mode="json"), producer="bench", correlation_id=alloc)
        c.sent[alloc] = time.perf_counter()
        await js.publish(
            "gpuaas.allocation.requested", env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id}
        )
    offered_s = time.perf_counter() - t0
    c.total_sent = True
    c.check()
    timed_out = False
    try:
        await asyncio.wait_for(c.done.wait(), timeout=max(120.0, duration * 10))
    except TimeoutError:
        timed_out = True
    left = await settle(admin_js, db, 120, settle_skip)
    window_s = time.perf_counter() - t0
    cpu = cpu_delta(before, cpu_snapshot(pids))
    await nc.drain()
    await admin.drain()
    await db.close()

    latencies = [(c.active[a] - c.sent[a]) * 1000 for a in c.active]
    per_alloc = {k: round(v / total, 2) for k, v in cpu.items()}
    net = {k: round(max(0.0, cpu[k] - idle[k] * window_s) / total, 2) for k in cpu}
    control = sum(per_alloc[s] for s in CONTROL_PLANE if s in per_alloc)
    control_net = sum(net[s] for s in CONTROL_PLANE if s in net)
    p50, p99 = pct(latencies, 0.5), pct(latencies, 0.99)
    return {
        "offered_per_s": rate,
        "requests": total,
        "achieved_offer_per_s": round(total / offered_s, 1),
        "active": len(c.active),
        "active_share": round(len(c.active) / total, 4),
        "released": len(c.released),
        "failed": len(c.failed),
        "failure_reasons": sorted(set(c.failed.values())),
        "timed_out": timed_out,
        "p50_ms": round(p50, 1),
        "p99_ms": round(p99, 1),
        "mean_ms": round(statistics.fmean(latencies), 1) if latencies else None,
        "window_s": round(window_s, 2),
        "cpu_ms_per_allocation": per_alloc,
        "cpu_ms_per_allocation_net_of_idle": net,
        "control_plane_cpu_ms_per_allocation": round(control, 2),
        "control_plane_cpu_ms_per_allocation_net_of_idle": round(control_net, 2),
        "cpu_cores_used": round(sum(v for k, v in cpu.items() if k != "bench-client") / 1000 / window_s, 2),
        "idle_cpu_ms_per_s": {k: round(v, 2) for k, v in idle.items()},
        "baseline_raw_jetstream": raw_js,
        "baseline_raw_postgres_commit": raw_pg,
        "p50_over_raw_jetstream_p50": _ratio(p50, raw_js["p50_ms"]),
        "p50_over_raw_commit_p50": _ratio(p50, raw_pg["p50_ms"]),
        "nats_cpu_over_raw_message": _ratio(net.get("nats-server"), raw_js["nats_server_cpu_ms_per_msg"]),
        "left_after_window": left,
        **({"latencies_ms": latencies} if keep_latencies else {}),
    }


# --- outbox relay and the older single-rate runs --------------------------------------------------------


async def e2e_latency(stack: Stack, rate: float, duration: float, gpus: int) -> dict:
    """requested -> active at one rate (releases sent on active); no CPU accounting."""
    point = await sweep_point(stack, stack_pids(stack), rate, duration, gpus, idle_s=0.5)
    keep = ("requests", "active", "failed", "failure_reasons", "p50_ms", "p99_ms", "mean_ms")
    return {k: point[k] for k in keep}


async def relay_vs_raw(stack: Stack, rows: int) -> dict:
    nc = await nats.connect(**stack.nats_options("admin"))
    js = nc.jetstream()
    body = m.AllocationReleaseRequested(allocation_id=uuid.uuid4(), reason="bench")

    # Baseline: the same number of JetStream publishes with PubAck, 64 in flight, no database.
    payloads = [
        Envelope.wrap(
            "allocation.release_requested", body.model_dump(mode="json"), producer="bench", correlation_id="raw"
        )
        .model_dump_json()
        .encode()
        for _ in range(rows)
    ]
    sem = asyncio.Semaphore(64)

    async def pub(i: int) -> None:
        async with sem:
            await js.publish("gpuaas.dlq.bench-raw", payloads[i], headers={"Nats-Msg-Id": f"raw-{uuid.uuid4()}"})

    t0 = time.perf_counter()
    await asyncio.gather(*(pub(i) for i in range(rows)))
    raw_s = time.perf_counter() - t0

    # Sequential publish-and-wait baseline (what a naive relay would do).
    n_seq = min(rows, 1000)
    t0 = time.perf_counter()
    for i in range(n_seq):
        await js.publish("gpuaas.dlq.bench-raw", payloads[i], headers={"Nats-Msg-Id": f"seq-{uuid.uuid4()}"})
    seq_s = time.perf_counter() - t0

    # In the maintenance database: no service's relay listens or locks there.
    conn = await asyncpg.connect(stack.admin_dsn)
    await conn.execute("DROP SCHEMA IF EXISTS bench_relay CASCADE")
    await apply_migrations(conn, "bench_relay", None)
    await conn.execute("SET search_path TO bench_relay")
    # Many aggregates, as in real traffic: order is kept per aggregate, so aggregates give parallelism.
    async with conn.transaction():
        writer = OutboxWriter(conn, "bench_relay", "bench")
        for i in range(rows):
            await writer.add(
                "allocation.release_requested",
                m.AllocationReleaseRequested(allocation_id=uuid.uuid4(), reason="bench"),
                aggregate_id=f"agg-{i % 500}",
            )
    relay = OutboxRelay(stack.admin_dsn, "bench_relay", js, batch_size=500, poll_interval_s=0.05)
    t0 = time.perf_counter()
    task = asyncio.create_task(relay.run())
    while relay.published < rows:  # noqa: ASYNC110 - the relay exposes a counter, not an event; a bench probe
        await asyncio.sleep(0.01)
    relay_s = time.perf_counter() - t0
    relay.stop()
    await task
    await conn.execute("DROP SCHEMA bench_relay CASCADE")
    await conn.close()
    await nc.drain()
    return {
        "rows": rows,
        "relay_per_s": round(rows / relay_s),
        "raw_jetstream_pipelined_per_s": round(rows / raw_s),
        "raw_jetstream_sequential_per_s": round(n_seq / seq_s),
        "relay_vs_pipelined_ratio": round((rows / relay_s) / (rows / raw_s), 3),
        "relay_vs_sequential_ratio": round((rows / relay_s) / (n_seq / seq_s), 3),
    }


def fleet_for(max_rate: float, duration: float, gpus: int) -> int:
    """Slice hosts (8 one-GPU slots each) for the largest point, every allocation on a slot of its own: a slot
    released on an instant host does not come back within the point (see `reset_slots`)."""
    return max(16, math.ceil(max_rate * duration * gpus * 1.1 / 8))


async def reset_slots(stack: Stack) -> dict[str, int]:
    """Instant hosts answer a release with wipe proofs labelled `simulated-instant`, a method no wipe policy
    accepts, so the scheduler rightly parks every released slot in cleanup_blocked. Between points (outside
    the measured window) the bench puts them back, as bench/scheduler.py resets capacity between rounds."""
    conn = await asyncpg.connect(stack.dsn_for("scheduler"), server_settings={"search_path": "scheduler"})
    try:
        before = {
            r["status"]: r["n"]
            for r in await conn.fetch("SELECT status, count(*) AS n FROM node_resource_slots GROUP BY status")
        }
        await conn.execute(
            "UPDATE node_resource_slots SET status = 'available', status_reason = NULL, health_state = 'healthy', "
            "health_detail = NULL, generation = generation + 1, updated_at = now() WHERE status = 'cleanup_blocked'"
        )
        await inv.refresh_nodes(conn)
    finally:
        await conn.close()
    return before


def _stack(
    run_dir: Path,
    hosts: int,
    instant: bool,
    *,
    auth: bool,
    nats_cluster: int,
    replicas: int,
    log_level: str,
    profile_dir: str,
    event_loop: str | None = None,
    baremetal_hosts: int = 0,
) -> Stack:
    overrides: dict = {"GPUAAS_LOG_LEVEL": log_level}
    if event_loop:
        overrides["GPUAAS_EVENT_LOOP"] = event_loop
    if profile_dir:
        overrides["GPUAAS_PROFILE_DIR"] = profile_dir  # see gpuaas_common/profiling.py
        if os.environ.get("GPUAAS_PROFILE_CLOCK"):
            overrides["GPUAAS_PROFILE_CLOCK"] = os.environ["GPUAAS_PROFILE_CLOCK"]
    if instant:
        overrides["node-agent"] = {"GPUAAS_SIM_INSTANT_HOSTS": "true"}
    kwargs: dict[str, Any] = {}
    if nats_cluster > 1:
        kwargs["nats_cluster"] = nats_cluster
    if replicas > 1:
        kwargs["replicas"] = replicas
    return Stack(
        run_dir,
        slice_hosts=hosts,
        slots_per_host=8,
        baremetal_hosts=baremetal_hosts,
        env_overrides=overrides,
        auth=auth,
        **kwargs,
    )


def side_stack(run_dir: Path, hosts: int, log_level: str, *, baremetal_hosts: int = 0) -> Stack:
    """The stack a bench beside this one measures on: instant slice hosts, one NATS server, one replica of each
    service, identities on, no profiling (read_model_lag.py, hostile_host.py)."""
    return _stack(
        run_dir,
        hosts,
        True,
        auth=True,
        nats_cluster=1,
        replicas=1,
        log_level=log_level,
        profile_dir="",
        baremetal_hosts=baremetal_hosts,
    )


async def _with_stack(stack: Stack, fn, keep_run_dir: bool = False, without: tuple[str, ...] = ()):
    try:
        await asyncio.get_running_loop().run_in_executor(None, stack.start)
        for service in without:
            # Stopped before any point: what the stack costs without it (an A/B against a tree that lacked it).
            stack.kill(service, signal.SIGTERM)
        return await fn(stack)
    finally:
        stack.stop()
        if not keep_run_dir:  # logs, databases and stream files: hundreds of MB per run
            shutil.rmtree(stack.run_dir, ignore_errors=True)


async def main_async(args: argparse.Namespace) -> dict:
    # Library logs go to stderr so that stdout carries only the JSON result.
    configure_logging("bench", "WARNING", stream=sys.stderr)
    rates = [float(r) for r in args.rates.split(",")]
    hosts = args.hosts or fleet_for(max(rates), args.duration, args.gpus)
    started = time.perf_counter()

    def new_stack(instant: bool = True, auth: bool = True) -> Stack:
        run_dir = Path(tempfile.mkdtemp(prefix="gpuaas-bench-"))
        return _stack(
            run_dir,
            hosts,
            instant,
            auth=auth,
            nats_cluster=args.nats_cluster,
            replicas=args.replicas,
            log_level=args.service_log_level,
            profile_dir=args.profile_dir,
            event_loop=args.event_loop,
        )

    async def sweep(stack: Stack) -> tuple[list[dict], dict]:
        pids = stack_pids(stack)
        # Untimed warm-up: pools grow, statement caches fill, first-use imports happen before any point.
        await sweep_point(stack, pids, 20.0, 1.0, args.gpus, 0.1)
        await reset_slots(stack)
        points = []
        for rate in rates:
            point = await sweep_point(stack, pids, rate, args.duration, args.gpus, args.idle_s)
            point["slots_after_point"] = await reset_slots(stack)
            print(
                json.dumps({k: point[k] for k in ("offered_per_s", "p50_ms", "p99_ms", "active_share")}),
                file=sys.stderr,
            )
            print(json.dumps(point["cpu_ms_per_allocation"]), file=sys.stderr)
            points.append(point)
        relay = await relay_vs_raw(stack, args.relay_rows) if args.relay_rows else {}
        return points, relay

    points, relay = await _with_stack(new_stack(), sweep, args.keep_run_dir, tuple(args.without))
    result: dict[str, Any] = {
        "benchmark": "pipeline",
        "sweep_instant_hosts": points,
        "outbox_relay": relay,
        "config": {
            "rates": rates,
            "duration_s": args.duration,
            "gpus": args.gpus,
            "slice_hosts": hosts,
            "slots": hosts * 8,
            "nats_servers": args.nats_cluster,
            "replicas": args.replicas,
            "stopped": args.without,
            "postgres": "durable (fsync, synchronous_commit on)",
            "service_log_level": args.service_log_level,
            "event_loop": args.event_loop or "the services' default",
            "cpus": os.cpu_count(),
        },
    }
    if args.full_rate:
        result["e2e_requested_to_active_full_simulated_hosts"] = await _with_stack(
            new_stack(instant=False),
            lambda s: e2e_latency(s, args.full_rate, args.duration, args.gpus),
            args.keep_run_dir,
        )
    if args.open_bus:
        # The same instant-host point on an open bus (no JWTs, no TLS): what identities cost.
        rate = 50.0 if 50.0 in rates else rates[0]
        auth_point = next(p for p in points if p["offered_per_s"] == rate)

        async def open_run(stack: Stack) -> tuple[dict, dict]:
            point = await sweep_point(stack, stack_pids(stack), rate, args.duration, args.gpus, args.idle_s)
            return point, await relay_vs_raw(stack, args.relay_rows) if args.relay_rows else {}

        open_point, open_relay = await _with_stack(new_stack(auth=False), open_run, args.keep_run_dir)
        result["auth_overhead"] = {
            "rate": rate,
            "open_bus_point": open_point,
            "open_bus_outbox_relay": open_relay,
            "p50_ratio_auth_over_open": _ratio(auth_point["p50_ms"], open_point["p50_ms"]),
            "control_plane_cpu_ratio_auth_over_open": _ratio(
                auth_point["control_plane_cpu_ms_per_allocation"], open_point["control_plane_cpu_ms_per_allocation"]
            ),
            "relay_rate_ratio_auth_over_open": _ratio(relay.get("relay_per_s"), open_relay.get("relay_per_s")),
        }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10,50,100,200", help="offered loads, allocations/s, comma-separated")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of offered load per point")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--hosts", type=int, default=0, help="slice hosts; default: sized so the top rate fits")
    parser.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle CPU measured before each point")
    parser.add_argument("--nats-cluster", type=int, default=1, help="NATS servers (3: a cluster, streams at R3)")
    parser.add_argument("--replicas", type=int, default=1, help="processes of each service (their CPU is summed)")
    parser.add_argument("--service-log-level", default="INFO", help="GPUAAS_LOG_LEVEL of every service")
    parser.add_argument(
        "--event-loop", choices=("uvloop", "asyncio"), help="GPUAAS_EVENT_LOOP of every service (default: theirs)"
    )
    parser.add_argument("--profile-dir", default="", help="cProfile every service into this directory")
    parser.add_argument("--full-rate", type=float, default=0.0, help="also run full simulated hosts at this rate")
    parser.add_argument("--open-bus", action="store_true", help="also run a point on an open bus (auth overhead)")
    parser.add_argument("--relay-rows", type=int, default=5000, help="outbox relay rows (0: skip)")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the stack's logs and data afterwards")
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        choices=["ops-view"],
        help="stop this process once the stack is up (not on an allocation's path; for an A/B against a tree "
        "without it)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for p in result["sweep_instant_hosts"]:
            print(
                f"{p['offered_per_s']:>6}/s p50 {p['p50_ms']} ms p99 {p['p99_ms']} ms active {p['active_share']:.1%} "
                f"control plane {p['control_plane_cpu_ms_per_allocation']} ms CPU/alloc {p['cpu_ms_per_allocation']}"
            )
        print("outbox_relay", result["outbox_relay"])


if __name__ == "__main__":
    main()
