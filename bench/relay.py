"""What relaying the outbox costs the relay at low load, where each commit's events go out on their own.

A committer writes outbox rows at a steady rate (K events per commit, as a handler's unit of work does) and
one `OutboxRelay` in its own process publishes them to a real nats-server; its CPU is read from /proc over
the window. Two ways to wake it, in the same run:

- `notified`: the commit's NOTIFY carries the rows (`outbox.pending_statement`), so the relay publishes
  without reading the table;
- `read` (baseline): the same rows with an empty NOTIFY, so the relay reads the table on every wake, as it
  did before notifications carried rows (and still does for rows too big for one).

A second baseline is the cheapest way to get the same messages into JetStream: a process that publishes
each one with a PubAck at the same rate, no database (CPU per message). The machine is noisy: read ratios.

    .venv/bin/python bench/relay.py [--rate 200] [--per-commit 1,3] [--seconds 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
import nats
import uvloop

from gpuaas_common.contract import messages as m
from gpuaas_common.db import text_literal
from gpuaas_common.jetstream import StreamSpec, ensure_stream
from gpuaas_common.logging import configure_logging
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.outbox import EventCollector, OutboxRelay, notify_channel, pending_statement
from gpuaas_dev.testing.cpu import process_cpu_s
from gpuaas_dev.testing.servers import NatsServer, PostgresServer
from gpuaas_dev.testing.waiting import eventually

SCHEMA = "bench_relay"
STREAM = StreamSpec("BENCHRELAY", ("gpuaas.allocation.>",), description="bench")


async def _relay_process(dsn: str, url: str) -> None:
    nc = await nats.connect(url)
    await OutboxRelay(dsn, SCHEMA, nc.jetstream()).run()


async def _publisher_process(url: str, rate: float, count: int) -> None:
    """The baseline: each message published with a PubAck at `rate`; prints its own CPU per message."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    body = json.dumps({"x": "y" * 600}).encode()
    start, cpu0 = time.monotonic(), time.process_time()
    for i in range(count):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        await js.publish("gpuaas.allocation.bench", body, headers={"Nats-Msg-Id": f"raw-{uuid.uuid4()}"})
    print(json.dumps({"cpu_us_per_message": round(1e6 * (time.process_time() - cpu0) / count, 1)}))
    await nc.drain()


async def _commits(conn: asyncpg.Connection, rate: float, per_commit: int, seconds: float, carry: bool) -> int:
    """Commit `per_commit` events at a time, `rate` commits a second; returns the events written."""
    commits = int(rate * seconds)
    start = time.monotonic()
    silent = f"SELECT pg_notify({text_literal(notify_channel(SCHEMA))}, '')"
    for i in range(commits):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        events = EventCollector("bench")
        agg = uuid.uuid4()
        for _ in range(per_commit):
            await events.add(
                "allocation.release_requested",
                m.AllocationReleaseRequested(allocation_id=agg, reason="bench " + "x" * 400),
                aggregate_id=str(agg),
            )
        statement = pending_statement(SCHEMA, events.pending)
        if not carry:
            statement = statement[: statement.rindex("; SELECT pg_notify(")] + "; " + silent
        await conn.execute(f"BEGIN; {statement}; COMMIT")
    return commits * per_commit


async def _point(dsn: str, url: str, rate: float, per_commit: int, seconds: float, carry: bool) -> dict:
    conn = await asyncpg.connect(dsn, server_settings={"search_path": SCHEMA})
    relay = await asyncio.create_subprocess_exec(sys.executable, __file__, "--relay-process", dsn, url)

    async def drained() -> bool:
        return not await conn.fetchval("SELECT count(*) FROM outbox")

    try:
        # The relay is leading once a first row goes through it.
        await _commits(conn, 20.0, 1, 0.5, carry)
        await eventually(drained, timeout=60, interval=0.05, what="the warm-up relayed")
        cpu0, t0 = process_cpu_s(relay.pid), time.monotonic()
        events = await _commits(conn, rate, per_commit, seconds, carry)
        await eventually(drained, timeout=120, interval=0.01, what="every event relayed")
        cpu = process_cpu_s(relay.pid) - cpu0
        return {
            "wake": "notified" if carry else "read",
            "commits_per_s": rate,
            "events_per_commit": per_commit,
            "events": events,
            "relay_cpu_us_per_event": round(1e6 * cpu / events, 1),
            "window_s": round(time.monotonic() - t0, 2),
        }
    finally:
        relay.terminate()
        await relay.wait()
        await conn.close()


async def main_async(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="gpuaas-bench-relay-"))
    nats_server = NatsServer(tmp / "nats").start()
    pg = PostgresServer(tmp / "pg").start()  # durable: fsync and synchronous_commit on
    try:
        nc = await nats.connect(nats_server.url)
        await ensure_stream(nc.jetstream(), STREAM)
        conn = await asyncpg.connect(pg.dsn)
        await apply_migrations(conn, SCHEMA, None)
        await conn.close()
        points = []
        for per_commit in [int(k) for k in args.per_commit.split(",")]:
            pair = {}
            for carry in (True, False):
                point = await _point(pg.dsn, nats_server.url, args.rate, per_commit, args.seconds, carry)
                pair[point["wake"]] = point
                print(json.dumps(point), file=sys.stderr)
            points.append(
                {
                    **pair,
                    "notified_over_read": round(
                        pair["notified"]["relay_cpu_us_per_event"] / pair["read"]["relay_cpu_us_per_event"], 3
                    ),
                }
            )
        publisher = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--publisher-process",
            nats_server.url,
            str(args.rate * 2),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await publisher.communicate()
        baseline = json.loads(out.decode().strip().splitlines()[-1])
        await nc.close()
    finally:
        pg.stop()
        nats_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "benchmark": "relay",
        "points": points,
        "baseline_raw_publish_with_puback": {"messages_per_s": args.rate * 2, **baseline},
        "cpus": os.cpu_count(),
    }


def main() -> None:
    # Both child processes run on the services' default loop.
    if sys.argv[1:2] == ["--relay-process"]:
        configure_logging("bench-relay", "WARNING", stream=sys.stderr)
        uvloop.run(_relay_process(sys.argv[2], sys.argv[3]))
        return
    if sys.argv[1:2] == ["--publisher-process"]:
        rate = float(sys.argv[3])
        uvloop.run(_publisher_process(sys.argv[2], rate, int(rate * 5)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="commits per second")
    parser.add_argument("--per-commit", default="1,3", help="events per commit, comma-separated")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure_logging("bench", "WARNING", stream=sys.stderr)
    result = asyncio.run(main_async(args))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
