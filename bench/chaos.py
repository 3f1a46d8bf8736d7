"""The long chaos run: >= 1,000 mixed slice and baremetal allocations and releases on a 3-node NATS cluster
with two replicas of every service, under seeded faults (see gpuaas_dev.testing.chaos), then the independent
checker. Prints the figures as JSON (recovery time per fault included); exits 1 when an invariant broke.

    .venv/bin/python bench/chaos.py [--allocations 1000] [--seed 1] [--clients 10]

Postgres runs durable (fsync and synchronous_commit on) except during the one fault that turns
synchronous_commit off on purpose. Timers shortened for the run: gpuaas_dev.testing.chaos.CHAOS_ENV.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile

from gpuaas_common.logging import configure_logging
from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.chaos import CHAOS_ENV, CHAOS_MAAS_TIMERS, ChaosPlan, run_chaos


async def main(args: argparse.Namespace) -> int:
    plan = ChaosPlan(
        seed=args.seed,
        allocations=args.allocations,
        clients=args.clients,
        baremetal_share=args.baremetal_share,
        keep_active=args.keep_active,
    )
    with tempfile.TemporaryDirectory(prefix="gpuaas-chaos-") as run_dir:
        stack = Stack(
            args.run_dir or run_dir,
            slice_hosts=args.slice_hosts,
            slots_per_host=8,
            baremetal_hosts=args.baremetal_hosts,
            nats_cluster=3,
            replicas=args.replicas,
            env_overrides=CHAOS_ENV,
            maas_timers=CHAOS_MAAS_TIMERS,
            log_level="WARNING",
            ready_timeout_s=180,
        )
        stack.start()
        try:
            report = await run_chaos(stack, plan)
        finally:
            stack.stop()
    if not args.fault_log:
        report.pop("fault_log")
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocations", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--baremetal-share", type=float, default=0.08)
    parser.add_argument("--keep-active", type=int, default=4)
    parser.add_argument("--slice-hosts", type=int, default=2)
    parser.add_argument("--baremetal-hosts", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--run-dir", help="keep the stack's logs here instead of a temporary directory")
    parser.add_argument("--fault-log", action="store_true", help="print every fault with its recovery figures")
    args = parser.parse_args()
    configure_logging("bench-chaos", "WARNING")
    # The portal's client reports every reconnect while a NATS server is down; that is the run, not news.
    logging.getLogger("nats.aio.client").setLevel(logging.CRITICAL)
    sys.exit(asyncio.run(main(args)))
