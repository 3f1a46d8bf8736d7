"""What a statement costs Postgres: the backend's CPU per execution, read from /proc, for the scheduler's hot
statements sent prepared (asyncpg's statement cache, the baseline) and as constant SQL (`db.bind_literals`,
what a write sent with the COMMIT looks like). A round trip saved on the client is worth it only when the
constant form does not cost Postgres more than that.

    .venv/bin/python bench/statements.py [--count 2000] [--json]

Printed per statement: Postgres CPU microseconds per execution, prepared and constant, and their ratio.
Postgres runs on this machine as the stack runs it (system binaries or the pgserver wheel).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

from gpuaas_common.db import bind_literals
from gpuaas_common.migrations import apply_migrations
from gpuaas_dev.testing.cpu import process_cpu_s
from gpuaas_dev.testing.servers import PostgresServer
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.inventory import capacity, slot_transitions


async def _per_call_us(conn: asyncpg.Connection, call: Callable[[], Awaitable[Any]], count: int) -> float:
    for _ in range(50):  # warm: plans cached, pages in memory
        await call()
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    before = process_cpu_s(pid)
    for _ in range(count):
        await call()
    return round((process_cpu_s(pid) - before) * 1e6 / count, 1)


async def main(count: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpuaas-bench-statements-") as run_dir:
        pg = PostgresServer(Path(run_dir) / "pg").start()
        try:
            conn = await asyncpg.connect(
                pg.dsn, server_settings={"search_path": "scheduler", "plan_cache_mode": "force_generic_plan"}
            )
            await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
            await synthetic.build(conn, slice_hosts=70, slots_per_host=8)
            move = slot_transitions._MOVE_ALLOCATION_SQL, uuid.uuid4(), "provisioning", None, ["reserved"]
            move_args = (*move, "scheduler", move[1], None, None, None)
            summary = (capacity._UPDATE_SUMMARY_SQL, "n00001", 5, 8, True, 2, 3, [3, 2], 4)
            out: dict[str, Any] = {}
            for name, (sql, *args) in (("slot move (a CTE)", move_args), ("node summary UPDATE", summary)):
                constant = bind_literals(sql, *args)
                prepared_us = await _per_call_us(conn, lambda s=sql, a=args: conn.execute(s, *a), count)
                constant_us = await _per_call_us(conn, lambda c=constant: conn.execute(c), count)
                out[name] = {
                    "prepared_us": prepared_us,
                    "constant_us": constant_us,
                    "constant_over_prepared": round(constant_us / max(prepared_us, 1e-9), 2),
                }
            await conn.close()
        finally:
            pg.stop()
    return {"postgres_cpu_per_execution": out, "count": count}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = asyncio.run(main(args.count))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, r in report["postgres_cpu_per_execution"].items():
            print(
                f"{name:22s} prepared {r['prepared_us']:7.1f} us  constant {r['constant_us']:7.1f} us  "
                f"ratio {r['constant_over_prepared']}"
            )
