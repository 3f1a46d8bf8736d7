"""How far ops-view's read models run behind the stream (issue 27, "Show it": read-model lag p99 under the 50/s
pipeline benchmark, goal <= 100 ms behind the stream).

The load is bench/pipeline.py's point, run as it runs there (a stack of instant simulated hosts with identities,
durable Postgres, allocations requested at the offered rate and released as each goes active; a warm-up point
first). While it runs, for every allocation event on the ALLOCATIONS stream (gpuaas.allocation.event.>, what
ops-view's allocations follower reads):

- stream time: the JetStream server's timestamp of the message, when it was stored;
- ops-view: when the bench sees ops-view's transaction holding it committed. The follower NOTIFYs
  `ops_view_changed` in the transaction that writes the rows and advances `stream_positions`, so the notice
  arrives only after that commit; on each one the bench reads the stream's committed position, and every event
  up to it is in the model by the time that read answers. The read's round trip is counted as lag: an upper
  bound, checked against ops-view's own lag histogram (observed right after each commit), reported beside;
- baseline, in the same run and the same process: an ordered push consumer of the bench on the same subjects,
  when each message reached it (nothing of ours between the stream and it).

Both lags are the bench's wall clock less the server's; the server runs on this machine, on the same clock.
Beside them: the rate the stream stored the events at and the rate the model committed them at (whether the
follower kept pace), ops-view's CPU per event, and the pipeline's own requested -> active latency (whether the
stack itself kept up with the load).

    .venv/bin/python bench/read_model_lag.py                       # 50/s for 20 s
    .venv/bin/python bench/read_model_lag.py --rate 50 --duration 30 --json

Not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import nats
import pipeline  # bench/pipeline.py, beside this file: the same stack and the same load
from nats.js.api import DeliverPolicy
from prometheus_client.parser import text_string_to_metric_families

from gpuaas_common.logging import configure_logging
from gpuaas_dev.stack import Stack

STREAM = "ALLOCATIONS"
SUBJECTS = "gpuaas.allocation.event.>"
CHANNEL = "ops_view_changed"  # services/ops-view: adapters/projection.py's CHANGED_CHANNEL
GOAL_MS = 100.0


@dataclass
class Observed:
    stored: dict[int, float] = field(default_factory=dict)  # stream seq -> the server's timestamp (epoch s)
    raw: dict[int, float] = field(default_factory=dict)  # stream seq -> when the bench's consumer had it
    # (committed position, when the bench read it), in the order read: the model holds every seq <= position.
    committed: list[tuple[int, float]] = field(default_factory=list)


class ModelWatch:
    """LISTENs for ops-view's commit notices and reads the allocations stream's committed position after each;
    one read at a time, and notices that come during a read ask for one more after it."""

    def __init__(self, conn: asyncpg.Connection, seen: Observed) -> None:
        self.conn, self.seen = conn, seen
        self._wanted = asyncio.Event()
        self._moved = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _notified(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        if payload == STREAM:
            self._wanted.set()

    async def start(self) -> None:
        await self.conn.add_listener(CHANNEL, self._notified)
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            pos = await self.conn.fetchval("SELECT last_seq FROM ops_view.stream_positions WHERE stream = $1", STREAM)
            if pos is not None:
                self.seen.committed.append((int(pos), time.time()))
                self._moved.set()

    async def reached(self, seq: int, timeout_s: float) -> bool:
        """Whether a read found the model at `seq` or past it within `timeout_s`: the load's last notice."""
        deadline = time.monotonic() + timeout_s
        while not (self.seen.committed and self.seen.committed[-1][0] >= seq):
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
        return True

    async def stop(self) -> None:
        await self.conn.remove_listener(CHANNEL, self._notified)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def lags(seen: Observed, first_seq: int) -> tuple[list[float], list[float], int]:
    """Per event since `first_seq`: ops-view's lag and the raw consumer's (ms), and the events the model was
    never seen holding."""
    # Read in time order; the model's position only grows (GREATEST), so positions are in order too and the
    # first read reaching a seq is the earliest that saw it committed.
    positions = [pos for pos, _ in seen.committed]
    model, raw, missing = [], [], 0
    for seq in sorted(s for s in seen.stored if s >= first_seq):
        stored = seen.stored[seq]
        if seq in seen.raw:
            raw.append((seen.raw[seq] - stored) * 1000)
        i = bisect.bisect_left(positions, seq)
        if i == len(positions):
            missing += 1
            continue
        model.append((seen.committed[i][1] - stored) * 1000)
    return model, raw, missing


async def own_histogram(stack: Stack) -> dict[str, float]:
    """ops-view's own lag histogram of the stream (gpuaas_ops_view_lag_seconds: observed right after each commit),
    cumulative count by upper bound: the same quantity seen from inside, to check the bench's view against."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.health_url('ops-view')}/metrics") as resp:
            text = await resp.text()
    return {
        sample.labels["le"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "gpuaas_ops_view_lag_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket") and sample.labels.get("stream") == STREAM
    }


def share_within(before: dict[str, float], after: dict[str, float], bound: str) -> float | None:
    total = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    return round((after.get(bound, 0.0) - before.get(bound, 0.0)) / total, 4) if total else None


def rates(seen: Observed, first_seq: int) -> dict[str, float | None]:
    """Events the stream stored per second over the load, and events the model committed per second from its
    first commit of the load to its last: the follower keeps pace when the second is the first."""
    stored = sorted(t for seq, t in seen.stored.items() if seq >= first_seq)
    seqs = sorted(seq for seq in seen.stored if seq >= first_seq)
    reads = [(pos, t) for pos, t in seen.committed if pos >= first_seq]
    out: dict[str, float | None] = {"stored_per_s": None, "committed_per_s": None}
    if len(stored) > 1 and stored[-1] > stored[0]:
        out["stored_per_s"] = round((len(stored) - 1) / (stored[-1] - stored[0]), 1)
    if len(reads) > 1 and reads[-1][1] > reads[0][1]:
        done = bisect.bisect_right(seqs, reads[-1][0]) - bisect.bisect_right(seqs, reads[0][0])
        out["committed_per_s"] = round(done / (reads[-1][1] - reads[0][1]), 1)
    return out


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "events": len(values),
        "p50_ms": round(pipeline.pct(values, 0.5), 2),
        "p95_ms": round(pipeline.pct(values, 0.95), 2),
        "p99_ms": round(pipeline.pct(values, 0.99), 2),
        "max_ms": round(max(values), 2) if values else None,
    }


async def measure(stack: Stack, rate: float, duration: float, gpus: int, idle_s: float) -> dict:
    pids = pipeline.stack_pids(stack)
    # Untimed warm-up, as bench/pipeline.py does: pools, caches and first-use imports before the point.
    await pipeline.sweep_point(stack, pids, 20.0, 1.0, gpus, 0.1)
    await pipeline.reset_slots(stack)

    seen = Observed()
    nc = await nats.connect(**stack.nats_options("admin"))
    js = nc.jetstream()

    async def on_msg(msg: Any) -> None:
        md = msg.metadata
        seen.raw[md.sequence.stream] = time.time()
        seen.stored[md.sequence.stream] = md.timestamp.timestamp()

    sub = await js.subscribe(
        SUBJECTS, stream=STREAM, cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
    )
    info = await js.stream_info(STREAM)
    first_seq = info.state.last_seq + 1
    conn = await asyncpg.connect(stack.dsn_for("ops-view"))
    watch = ModelWatch(conn, seen)
    await watch.start()
    # ops-view is no part of the pipeline's accounting: its CPU over the point says whether it kept up or starved.
    ops_view = {"ops-view": [pid for pid in (stack.pid("ops-view"),) if pid]}
    try:
        histogram_before = await own_histogram(stack)
        cpu_before, t0 = pipeline.cpu_snapshot(ops_view), time.perf_counter()
        point = await pipeline.sweep_point(stack, pids, rate, duration, gpus, idle_s)
        cpu = pipeline.cpu_delta(cpu_before, pipeline.cpu_snapshot(ops_view))["ops-view"]
        cpu_window_s = time.perf_counter() - t0
        # The load is over and settled (every durable drained): the model's last notice may still be on its way.
        # Its last event (the stream's last message may be a request, which the model does not follow).
        await watch.reached(max(seen.stored, default=first_seq), 30.0)
        histogram_after = await own_histogram(stack)
    finally:
        await watch.stop()
        await conn.close()
        await sub.unsubscribe()
        await nc.drain()

    model, raw, missing = lags(seen, first_seq)
    model_s, raw_s = summary(model), summary(raw)
    return {
        "offered_per_s": rate,
        "allocations": point["requests"],
        "active_share": point["active_share"],
        "requested_to_active_p50_ms": point["p50_ms"],
        "requested_to_active_p99_ms": point["p99_ms"],
        "allocation_events": len([s for s in seen.stored if s >= first_seq]),
        "allocation_events_per_s": rates(seen, first_seq),
        "ops_view_lag": model_s,
        "ops_view_events_never_seen_committed": missing,
        # ops-view's own histogram over the point (warm-up excluded), in its buckets: the check on the above.
        "ops_view_own_histogram_share_within": {
            f"{b}s": share_within(histogram_before, histogram_after, b) for b in ("0.1", "1.0", "5.0")
        },
        "baseline_raw_jetstream_consumer_lag": raw_s,
        "p99_over_raw_p99": round(model_s["p99_ms"] / raw_s["p99_ms"], 2) if raw and raw_s["p99_ms"] else None,
        "goal_p99_ms": GOAL_MS,
        "within_goal": bool(model) and model_s["p99_ms"] <= GOAL_MS,
        "commit_notices_read": len(seen.committed),
        # Over the whole point (its idle and baseline phases too): an upper bound per event.
        "ops_view_cpu_ms_per_event": round(cpu / len(model), 3) if model else None,
        "ops_view_cpu_cores": round(cpu / 1000 / cpu_window_s, 3),
        "pipeline_cpu_cores_used": point["cpu_cores_used"],
        "machine_load_average": os.getloadavg(),
    }


async def main_async(args: argparse.Namespace) -> dict:
    configure_logging("bench", "WARNING", stream=sys.stderr)
    started = time.perf_counter()
    hosts = args.hosts or pipeline.fleet_for(args.rate, args.duration, args.gpus)
    stack = pipeline.side_stack(Path(tempfile.mkdtemp(prefix="gpuaas-bench-")), hosts, args.service_log_level)
    result = await pipeline._with_stack(
        stack, lambda s: measure(s, args.rate, args.duration, args.gpus, args.idle_s), args.keep_run_dir
    )
    result["config"] = {
        "duration_s": args.duration,
        "gpus": args.gpus,
        "slice_hosts": hosts,
        "postgres": "durable (fsync, synchronous_commit on)",
        "cpus": os.cpu_count(),
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=50.0, help="offered load, allocations/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of offered load")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--hosts", type=int, default=0, help="slice hosts; default: sized so the load fits")
    parser.add_argument("--idle-s", type=float, default=1.0, help="seconds of idle CPU measured before the point")
    parser.add_argument("--service-log-level", default="INFO", help="GPUAAS_LOG_LEVEL of every service")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the stack's logs and data afterwards")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    m, r = result["ops_view_lag"], result["baseline_raw_jetstream_consumer_lag"]
    print(
        f"{result['offered_per_s']}/s, {result['allocation_events']} allocation events "
        f"({result['allocation_events_per_s']}), requested->active p99 {result['requested_to_active_p99_ms']} ms"
    )
    print(f"ops-view model lag   p50 {m['p50_ms']} p95 {m['p95_ms']} p99 {m['p99_ms']} max {m['max_ms']} ms")
    print(f"raw JetStream lag    p50 {r['p50_ms']} p95 {r['p95_ms']} p99 {r['p99_ms']} max {r['max_ms']} ms")
    print(f"goal p99 <= {GOAL_MS} ms: {'met' if result['within_goal'] else 'NOT met'}")


if __name__ == "__main__":
    main()
