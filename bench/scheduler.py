"""Placement throughput and latency of the scheduler's service layer against Postgres (fsync on),
next to a raw baseline measured on the same server in the same run.

    .venv/bin/python bench/scheduler.py --json                 # 100, 1,000 and 5,000 nodes
    .venv/bin/python bench/scheduler.py --nodes 5000 --json

Each worker is an OS process running the real handler (`Scheduler.on_accepted`: inbox row, quota,
index-ordered candidates, SKIP LOCKED node and slot locks, claims, outbox) in one transaction per
request, exactly as the bus would, minus NATS. The baseline is one `SKIP LOCKED` slot claim plus one
outbox insert per transaction. Capacity is reset between rounds (untimed) so a small fleet never
runs dry. Not a test: it prints numbers; compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.logging import configure_logging
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_dev.testing.servers import PostgresServer
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.service_layer.handlers import Scheduler, allocation_first_lock
from gpuaas_scheduler.service_layer.placement import PlacementPolicy, with_fleet_shape

SLOTS = 8


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


async def _placements(dsn: str, gpus: int, count: int, start_at: float) -> dict:
    # The services' own pool (search_path, and no reset query on release), one connection per worker.
    pool = await create_pool(dsn, "scheduler", min_size=1, max_size=1)
    async with pool.acquire() as conn:
        scheduler = Scheduler(await with_fleet_shape(conn, PlacementPolicy()))
    image = m.ImageRef(slug="img", digest_sha256="0" * 64, image_path="/img")
    lat: list[float] = []
    placed = 0
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    for _ in range(count):
        ev = m.AllocationAccepted(
            allocation_id=uuid.uuid4(),
            tenant_id="bench",
            shape="gpu_slice",
            state="accepted",
            seq=2,
            sku="h200-sxm-slice",
            gpu_count=gpus,
            region="default",
            image=image,
        )
        env = Envelope.wrap(
            "allocation.accepted", ev.model_dump(mode="json"), producer="bench", correlation_id=str(ev.allocation_id)
        )
        s = time.perf_counter()
        # Exactly what the bus does per message: inbox row, the allocation's lock taken with the BEGIN (the
        # service subscribes with `first_lock=allocation_first_lock`), placement, outbox, one unit of work.
        ctx = HandlerContext(env, ev, "gpuaas.allocation.event.accepted", "scheduler-allocation-events", 1)
        await deliver(
            scheduler.on_accepted,
            ctx,
            first_lock=allocation_first_lock(ev),
            uow=UnitOfWork(
                pool,
                "scheduler",
                "scheduler",
                scheduler_repositories,
                correlation_id=env.correlation_id,
                causation_id=env.event_id,
            ),
        )
        lat.append((time.perf_counter() - s) * 1000)
        placed += 1
    t1 = time.time()
    await pool.close()
    return {"lat": lat, "n": placed, "t0": t0, "t1": t1}


async def _baseline(dsn: str, gpus: int, count: int, start_at: float) -> dict:
    conn = await asyncpg.connect(dsn, server_settings={"search_path": "scheduler"})
    lat: list[float] = []
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    for _ in range(count):
        s = time.perf_counter()
        async with conn.transaction():
            slot = await conn.fetchval(
                "UPDATE node_resource_slots SET status = 'reserved' WHERE slot_id = (SELECT slot_id FROM "
                "node_resource_slots WHERE status = 'available' LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING slot_id"
            )
            await conn.execute(
                "INSERT INTO outbox (event_id, aggregate_id, subject, body) VALUES ($1, $2, $3, $4)",
                str(uuid.uuid4()),
                str(slot),
                "gpuaas.scheduler.placement.placed",
                b"{}",
            )
        lat.append((time.perf_counter() - s) * 1000)
    t1 = time.time()
    await conn.close()
    return {"lat": lat, "n": count, "t0": t0, "t1": t1}


def run_round(kind: str, dsn: str, gpus: int, count: int, start_at: float) -> dict:
    # The handler logs every placement at info; the benchmark measures placement, not log rendering.
    configure_logging("bench-scheduler", "WARNING")
    fn = _placements if kind == "scheduler" else _baseline
    return asyncio.run(fn(dsn, gpus, count, start_at))


async def reset(conn: asyncpg.Connection, history: bool = True) -> None:
    # The fleet starts with a history (`seed_history`), and between rounds the round's claims are released, as
    # the fleet releases them (it never deletes a claim), and the tables analysed, as autovacuum would have done.
    # Truncating instead (`--truncate-claims`, what this bench did before) starts every round against an empty
    # table, and the plans each worker caches at its first placement (the services force generic plans) then
    # scan every claim of the round in each rule that reads a node's live claims: a cost no running fleet pays,
    # growing with the round.
    if history:
        await conn.execute(
            "UPDATE allocation_resource_claims SET status = 'released', released_at = clock_timestamp() "
            "WHERE status <> 'released'"
        )
        await conn.execute("TRUNCATE outbox, inbox")
    else:
        await conn.execute("TRUNCATE allocation_resource_claims, outbox, inbox")
    await conn.execute("UPDATE node_resource_slots SET status = 'available' WHERE status <> 'available'")
    await inv.refresh_nodes(conn)
    await conn.execute("VACUUM ANALYZE nodes")
    await conn.execute("VACUUM ANALYZE node_resource_slots")
    await conn.execute("VACUUM ANALYZE allocation_resource_claims")


async def seed_history(conn: asyncpg.Connection) -> None:
    """One released claim per slot: a fleet that has run for a while, whose claims table (claims are released,
    never deleted) is larger than any round's live claims and whose statistics say so."""
    await conn.execute(
        "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, "
        "fencing_epoch, tenant_id, gpus, released_at) SELECT gen_random_uuid(), node_id, slot_id, 'slot', "
        "'released', nextval('fencing_epoch_seq'), 'earlier', 1, clock_timestamp() FROM node_resource_slots"
    )


async def double_booked(conn: asyncpg.Connection) -> int:
    return await conn.fetchval(
        "SELECT count(*) FROM (SELECT slot_id FROM allocation_resource_claims WHERE status <> 'released' "
        "AND slot_id IS NOT NULL GROUP BY slot_id HAVING count(*) > 1) d"
    )


async def measure(
    conn: asyncpg.Connection,
    pool,
    dsn: str,
    kind: str,
    nodes: int,
    gpus: int,
    workers: int,
    total: int,
    history: bool = True,
) -> dict:
    # A round uses at most half the fleet's groups, so placements never run short of capacity.
    per_round = max(workers, min(total, nodes * (SLOTS // gpus) // 2))
    lat: list[float] = []
    placed = 0
    window = 0.0
    booked = 0
    done = 0
    while done < total:
        n = min(per_round, total - done)
        await reset(conn, history)
        start_at = time.time() + 0.3
        shares = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
        parts = await asyncio.get_running_loop().run_in_executor(
            None, lambda args=[(kind, dsn, gpus, s, start_at) for s in shares if s]: pool.starmap(run_round, args)
        )
        booked += await double_booked(conn)
        for p in parts:
            lat += p["lat"]
            placed += p["n"]
        window += max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
        done += n
    return {
        "per_s": placed / window if window else 0.0,
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "n": placed,
        "double_booked": booked,
    }


async def bench(sizes: list[int], count1: int, count4: int, workers_list: list[int], history: bool = True) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="gpuaas-bench-sched-"))
    pg = PostgresServer(tmp / "pg").start()  # durable: fsync and synchronous_commit on
    ctx = mp.get_context("spawn")
    results = []
    try:
        admin = await asyncpg.connect(pg.dsn)
        with ctx.Pool(max(workers_list)) as pool:
            for nodes in sizes:
                db = f"bench_{nodes}"
                await admin.execute(f'CREATE DATABASE "{db}"')
                dsn = pg.dsn.rsplit("/", 1)[0] + f"/{db}"
                conn = await asyncpg.connect(dsn, server_settings={"search_path": "scheduler"})
                await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
                await synthetic.build(conn, slice_hosts=nodes, slots_per_host=SLOTS)
                if history:
                    await seed_history(conn)
                for workers in workers_list:
                    base = await measure(conn, pool, dsn, "baseline", nodes, 1, workers, count1, history)
                    for gpus, count in ((1, count1), (4, count4)):
                        r = await measure(conn, pool, dsn, "scheduler", nodes, gpus, workers, count, history)
                        row = {
                            "nodes": nodes,
                            "slots_per_node": SLOTS,
                            "gpus": gpus,
                            "workers": workers,
                            "placements": r["n"],
                            "placements_per_s": round(r["per_s"], 1),
                            "baseline_per_s": round(base["per_s"], 1),
                            "ratio": round(r["per_s"] / base["per_s"], 3) if base["per_s"] else None,
                            "p50_ms": round(r["p50_ms"], 3),
                            "p99_ms": round(r["p99_ms"], 3),
                            "baseline_p50_ms": round(base["p50_ms"], 3),
                            "double_booked": r["double_booked"],
                        }
                        results.append(row)
                        print(json.dumps(row), file=sys.stderr)
                await conn.close()
        await admin.close()
    finally:
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    summary: dict = {"runs": results, "fsync": True, "cpus": mp.cpu_count(), "claims_history": history}
    by = {(r["nodes"], r["gpus"], r["workers"]): r for r in results}
    lo, hi = min(sizes), max(sizes)
    if lo != hi:
        for gpus in (1, 4):
            for w in workers_list:
                if (lo, gpus, w) in by and (hi, gpus, w) in by:
                    summary[f"p50_growth_{lo}_to_{hi}_gpus{gpus}_w{w}"] = round(
                        by[(hi, gpus, w)]["p50_ms"] / by[(lo, gpus, w)]["p50_ms"], 3
                    )
    best = max((r for r in results if r["nodes"] == hi and r["gpus"] == 1), key=lambda r: r["placements_per_s"])
    summary.update({k: best[k] for k in ("placements_per_s", "baseline_per_s", "ratio", "p50_ms", "p99_ms")})
    summary["headline"] = f"1-GPU at {hi} nodes, {best['workers']} workers"
    summary["double_booked"] = sum(r["double_booked"] for r in results)
    return summary


def main() -> None:
    configure_logging("bench-scheduler", "WARNING")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, action="append", help="fleet size (repeatable); default 100, 1000, 5000")
    ap.add_argument("--count", type=int, default=1500, help="1-GPU placements per configuration")
    ap.add_argument("--count4", type=int, default=800, help="4-GPU placements per configuration")
    ap.add_argument("--workers", type=int, action="append", help="worker processes (repeatable); default 1 and 4")
    ap.add_argument(
        "--truncate-claims",
        action="store_true",
        help="no claims history: an empty claims table at the start and between rounds (the old reset)",
    )
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    args = ap.parse_args()
    summary = asyncio.run(
        bench(
            args.nodes or [100, 1000, 5000],
            args.count,
            args.count4,
            args.workers or [1, 4],
            history=not args.truncate_claims,
        )
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for r in summary["runs"]:
            print(
                f"{r['nodes']:>5} nodes {r['gpus']} GPU w={r['workers']}: {r['placements_per_s']:8.1f}/s "
                f"(baseline {r['baseline_per_s']:8.1f}/s, ratio {r['ratio']}) p50 {r['p50_ms']} ms "
                f"p99 {r['p99_ms']} ms double_booked={r['double_booked']}"
            )


if __name__ == "__main__":
    main()
