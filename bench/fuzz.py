"""The long fuzzing run: hostile input on every subject our durables read (see gpuaas_dev.testing.fuzz),
then the independent checker, then a normal allocation. Prints the figures as JSON; exits 1 when an
invariant broke.

    .venv/bin/python bench/fuzz.py [--count 10000] [--seed 1]

The baseline printed next to the run is the same number of well-formed allocation requests' worth of
publishes measured on the same stack, so the drain time of hostile input reads as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid

import nats

from gpuaas_common.logging import configure_logging
from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.fuzz_run import SLICE_REQUEST, _portal_publish, run_fuzz


async def serves_an_allocation(stack: Stack, spy: BusSpy) -> float:
    nc = await nats.connect(**stack.nats_options("portal"))
    js = nc.jetstream()
    alloc = str(uuid.uuid4())
    started = time.monotonic()
    await _portal_publish(
        js, "gpuaas.allocation.requested", "allocation.requested", {**SLICE_REQUEST, "allocation_id": alloc}
    )
    await spy.wait_type("allocation.active", timeout=120, allocation_id=alloc)
    elapsed = time.monotonic() - started
    await _portal_publish(
        js, "gpuaas.allocation.release_requested", "allocation.release_requested", {"allocation_id": alloc}
    )
    await spy.wait_type("allocation.released", timeout=120, allocation_id=alloc)
    await nc.drain()
    return elapsed


async def main(count: int, seed: int) -> int:
    with tempfile.TemporaryDirectory(prefix="gpuaas-fuzz-") as run_dir:
        stack = Stack(run_dir, slice_hosts=2, slots_per_host=8, baremetal_hosts=2, log_level="WARNING")
        stack.start()
        try:
            spy = await BusSpy(stack.nats_url, connect=stack.nats_options("admin")).start()
            admin = await nats.connect(**stack.nats_options("admin"))
            db = await stack.open_databases()
            baseline_s = await serves_an_allocation(stack, spy)
            report = await run_fuzz(stack, spy, admin, db, count=count, seed=seed, drain_timeout_s=600)
            report["allocation_after_s"] = round(await serves_an_allocation(stack, spy), 3)
            report["allocation_before_s"] = round(baseline_s, 3)
            report["hostile_per_s"] = round(report["sent"] / max(report["drained_s"], 1e-9), 1)
            await db.close()
            await admin.drain()
            await spy.stop()
        finally:
            stack.stop()
    ok = not (
        report["crashed_processes"]
        or report["undrained_consumers"]
        or report["dlq_problems"]
        or report["missing_dead_letters"]
        or report["database_violations"]
    )
    report["by_type"] = dict(sorted(report["by_type"].items()))
    report["database_violations"] = report["database_violations"][:20]
    print(json.dumps({"ok": ok, **report}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    configure_logging("bench-fuzz", "WARNING")
    sys.exit(asyncio.run(main(args.count, args.seed)))
