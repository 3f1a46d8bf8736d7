"""End-to-end latency (requested -> active) at a steady request rate, and outbox relay throughput
next to a raw JetStream publish rate measured in the same run.

Two stacks run one after the other: one whose simulated hosts answer tasks instantly (the control
plane alone, at --rate), and one whose simulated hosts do the real work (qemu-img clone, seed ISO,
libvirt test driver, DHCP lease and SSH banner, zero-fill wipe and verification) at --full-rate.

    .venv/bin/python bench/pipeline.py --json [--rate 50] [--duration 10]

Not a test: it prints numbers. The machine is noisy, so compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
import nats

from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import configure_logging
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.outbox import OutboxRelay, OutboxWriter
from gpuaas_dev.stack import Stack


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def e2e_latency(stack: Stack, rate: float, duration: float, gpus: int) -> dict:
    # As the portal: publishes requests and releases, reads the lifecycle (on an open stack: anonymous).
    nc = await nats.connect(**stack.nats_options("portal"))
    js = nc.jetstream()
    sent: dict[str, float] = {}
    active: dict[str, float] = {}
    failed: dict[str, str] = {}
    done = asyncio.Event()
    total = int(rate * duration)

    async def on_event(msg) -> None:
        data = json.loads(msg.data)
        alloc = data["payload"].get("allocation_id")
        if alloc not in sent:
            return
        kind = data["type"]
        if kind == "allocation.active":
            active[alloc] = time.perf_counter()
            release = m.AllocationReleaseRequested(allocation_id=uuid.UUID(alloc), reason="bench")
            env = Envelope.wrap(
                "allocation.release_requested", release.model_dump(mode="json"), producer="bench", correlation_id=alloc
            )
            await js.publish(
                "gpuaas.allocation.release_requested",
                env.model_dump_json().encode(),
                headers={"Nats-Msg-Id": env.event_id},
            )
        elif kind in ("allocation.failed", "allocation.unschedulable", "allocation.rejected"):
            failed[alloc] = data["payload"].get("reason_code", kind)
        if len(active) + len(failed) >= total:
            done.set()

    await nc.subscribe("gpuaas.allocation.event.>", cb=on_event)
    start = time.perf_counter()
    for i in range(total):
        target = start + i / rate
        delay = target - time.perf_counter()
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
        sent[alloc] = time.perf_counter()
        await js.publish(
            "gpuaas.allocation.requested", env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id}
        )
    offered_s = time.perf_counter() - start
    try:
        await asyncio.wait_for(done.wait(), timeout=max(60.0, duration * 6))
    except asyncio.TimeoutError:
        pass
    await nc.drain()
    latencies = [(active[a] - sent[a]) * 1000 for a in active]
    return {
        "requests": total,
        "offered_rate_per_s": round(total / offered_s, 1),
        "active": len(active),
        "failed": len(failed),
        "failure_reasons": sorted(set(failed.values())),
        "p50_ms": round(pct(latencies, 0.50), 1),
        "p99_ms": round(pct(latencies, 0.99), 1),
        "mean_ms": round(statistics.fmean(latencies), 1) if latencies else None,
    }


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

    conn = await asyncpg.connect(stack.dsn)
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
    relay = OutboxRelay(stack.dsn, "bench_relay", js, batch_size=500, poll_interval_s=0.05)
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


async def _with_stack(hosts: int, instant: bool, fn, *, auth: bool = True):
    run_dir = Path(tempfile.mkdtemp(prefix="gpuaas-bench-"))
    overrides: dict = {"GPUAAS_LOG_LEVEL": "WARNING"}
    if instant:
        overrides["node-agent"] = {"GPUAAS_SIM_INSTANT_HOSTS": "true"}
    stack = Stack(run_dir, slice_hosts=hosts, slots_per_host=8, baremetal_hosts=0, env_overrides=overrides, auth=auth)
    stack.start()
    try:
        return await fn(stack)
    finally:
        stack.stop()


async def main_async(args: argparse.Namespace) -> dict:
    # Library logs go to stderr so that stdout carries only the JSON result.
    configure_logging("bench", "WARNING", stream=sys.stderr)

    async def instant_run(stack: Stack) -> tuple[dict, dict]:
        e2e = await e2e_latency(stack, args.rate, args.duration, args.gpus)
        relay = await relay_vs_raw(stack, args.relay_rows)
        return e2e, relay

    e2e, relay = await _with_stack(args.hosts, True, instant_run)
    full = await _with_stack(
        args.hosts, False, lambda stack: e2e_latency(stack, args.full_rate, args.duration, args.gpus)
    )
    # The same instant-host run on an open bus (no JWTs, no TLS): what identities cost.
    open_e2e, open_relay = await _with_stack(args.hosts, True, instant_run, auth=False)
    return {
        "benchmark": "pipeline",
        "e2e_requested_to_active_instant_hosts": e2e,
        "e2e_requested_to_active_full_simulated_hosts": full,
        "outbox_relay": relay,
        "auth_overhead": {
            "open_bus_e2e_instant_hosts": open_e2e,
            "open_bus_outbox_relay": open_relay,
            "p50_ratio_auth_over_open": _ratio(e2e["p50_ms"], open_e2e["p50_ms"]),
            "p99_ratio_auth_over_open": _ratio(e2e["p99_ms"], open_e2e["p99_ms"]),
            "relay_rate_ratio_auth_over_open": _ratio(relay["relay_per_s"], open_relay["relay_per_s"]),
            "raw_publish_ratio_auth_over_open": _ratio(
                relay["raw_jetstream_pipelined_per_s"], open_relay["raw_jetstream_pipelined_per_s"]
            ),
        },
        "config": {
            "rate": args.rate,
            "full_rate": args.full_rate,
            "duration_s": args.duration,
            "gpus": args.gpus,
            "slice_hosts": args.hosts,
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument(
        "--full-rate",
        type=float,
        default=5.0,
        help="request rate for the run on full simulated hosts (real qemu-img, libvirt, wipe)",
    )
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--relay-rows", type=int, default=5000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for section, values in result.items():
            print(section, values, file=sys.stdout)


if __name__ == "__main__":
    main()
