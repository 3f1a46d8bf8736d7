"""What the ops console's first pages cost the server with 10,000 allocations and 1,000 hosts in the read
models (issue 27's goal: at most 300 ms of server time for the first page).

The ops API with its console runs in this process on a fresh Postgres (the read models' own migrations), filled
with allocations (each with its timeline), hosts with their slots, and a month of usage records. Each page is
asked `--requests` times after a warm-up; the server time of a request is measured by the outermost middleware
of the application (auth, queries, rendering; the socket's transfer not included). Printed beside each page, from
the same run: the same read without rendering, called directly (`query`), and the JSON API route that answers
it (`api`, the same middleware). The fleet is measured without the scheduler's admin API (its node view is a
call to another process, not the models). The machine is noisy: read ratios and the p50.

    .venv/bin/python bench/console.py [--allocations 10000] [--hosts 1000] [--requests 40] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from aiohttp import web
from pydantic import SecretStr

from gpuaas_common.admin_http import login_link
from gpuaas_common.contract import AllocationState as A
from gpuaas_common.db import create_pool
from gpuaas_common.logging import configure_logging
from gpuaas_common.migrations import apply_migrations
from gpuaas_dev.testing.servers import PostgresServer
from gpuaas_ops_view.adapters.changes import Changes
from gpuaas_ops_view.adapters.scheduler_admin import SchedulerAdmin
from gpuaas_ops_view.entrypoints.admin_http import ops_api
from gpuaas_ops_view.entrypoints.web.pages import Console
from gpuaas_ops_view.service_layer import queries

SCHEMA = "ops_view"
TOKEN = "bench-console-token-0123456789"
LOGIN_SECRET = "bench-console-login-secret-0123"
GOAL_MS = 300.0
STATES = (A.ACTIVE,) * 6 + (A.RELEASED,) * 2 + (A.PROVISIONING, A.UNSCHEDULABLE, A.FAILED, A.PLACED)
TIMELINE = (A.ACCEPTED, A.PLACED, A.PROVISIONING, A.ACTIVE, A.RELEASING, A.RELEASED)


def _allocation_rows(count: int, hosts: list[str], now: datetime) -> tuple[list[tuple], list[tuple], list[tuple]]:
    rnd = random.Random(7)
    allocations, timeline, usage = [], [], []
    for i in range(count):
        alloc = uuid.UUID(int=rnd.getrandbits(128))
        state = STATES[i % len(STATES)]
        created = now - timedelta(seconds=count - i)
        node = None if state == "unschedulable" else hosts[i % len(hosts)]
        why_not = (
            json.dumps({"filtered": {"region": 3}, "free_gpus": 0, "requested_gpus": 2})
            if state == "unschedulable"
            else None
        )
        allocations.append(
            (alloc, f"tenant-{i % 97}", "gpu_slice", state, 4, "h200-sxm-slice", 2, "default",
             "ubuntu-24.04-h200-slice", node, "slots" if node else None, None, None, None, why_not, created,
             created + timedelta(seconds=1))
        )  # fmt: skip
        steps = TIMELINE[: TIMELINE.index(state) + 1] if state in TIMELINE else ("accepted", state)
        for seq, (before, step) in enumerate(zip((None, *steps), steps, strict=False), start=1):
            at = created + timedelta(milliseconds=seq)
            timeline.append((alloc, seq, step, before, f"ev-{alloc}-{seq}", at, "{}"))
        if state in (A.ACTIVE, A.RELEASED):
            stopped = created + timedelta(seconds=600) if state == "released" else None
            usage.append(
                (alloc, f"tenant-{i % 97}", "gpu_slice", "h200-sxm-slice", 2, "default", node,
                 created.replace(microsecond=0), stopped.replace(microsecond=0) if stopped else None,
                 "released" if stopped else None, None, f"ev-{alloc}-4", f"ev-{alloc}-6" if stopped else None)
            )  # fmt: skip
    return allocations, timeline, usage


async def _fill(dsn: str, allocations: int, hosts: int) -> uuid.UUID:
    """The models as the followers would have left them; returns one allocation to open."""
    now = datetime.now(timezone.utc).replace(day=1, hour=12) + timedelta(days=14)
    conn = await asyncpg.connect(dsn, server_settings={"search_path": SCHEMA})
    try:
        nodes = [f"slice-{i:04d}" for i in range(hosts)]
        await conn.copy_records_to_table(
            "hosts",
            columns=[
                "node_id",
                "kind",
                "hostname",
                "agent_version",
                "parity_failures",
                "parity_checked_at",
                "topology_gpus",
                "topology_at",
                "drift",
                "drift_checked_at",
                "updated_at",
            ],  # fmt: skip
            records=[(n, "slice_host", n, "0.1.0", 0, now, 8, now, "[]", now, now) for n in nodes],
        )
        await conn.copy_records_to_table(
            "slots",
            columns=["node_id", "slot_id", "profile", "gpu_pci", "first_seen"],
            records=[(n, f"{n}-s{s}", "default", f"0000:1{s}:00.0", now) for n in nodes for s in range(8)],
        )
        rows, timeline, usage = _allocation_rows(allocations, nodes, now)
        await conn.copy_records_to_table(
            "allocations",
            columns=[
                "allocation_id",
                "tenant_id",
                "shape",
                "state",
                "seq",
                "sku",
                "gpu_count",
                "region",
                "image",
                "node_id",
                "claim_mode",
                "reason_code",
                "reason",
                "access",
                "why_not",
                "created_at",
                "updated_at",
            ],  # fmt: skip
            records=rows,
        )
        await conn.copy_records_to_table(
            "allocation_timeline",
            columns=["allocation_id", "seq", "state", "previous_state", "event_id", "at", "detail"],
            records=timeline,
        )
        await conn.copy_records_to_table(
            "usage_records",
            columns=[
                "allocation_id",
                "tenant_id",
                "shape",
                "sku",
                "gpu_count",
                "region",
                "node_id",
                "started_at",
                "stopped_at",
                "ended",
                "end_reason_code",
                "start_event_id",
                "stop_event_id",
            ],  # fmt: skip
            records=usage,
        )
        await conn.execute("ANALYZE")
        return rows[-1][0]
    finally:
        await conn.close()


def _summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        "p50_ms": round(statistics.median(ms), 2),
        "p95_ms": round(ms[max(0, int(len(ms) * 0.95) - 1)], 2),
        "max_ms": round(ms[-1], 2),
    }


async def _measure(requests: int, ask: Callable[[], Awaitable[None]], server: list[float] | None) -> dict[str, float]:
    for _ in range(5):  # warm: plans cached, pages in memory, templates compiled
        await ask()
    if server is not None:
        server.clear()
    took = []
    for _ in range(requests):
        start = time.perf_counter()
        await ask()
        took.append(time.perf_counter() - start)
    return _summary(list(server) if server is not None else took)


async def main(allocations: int, hosts: int, requests: int) -> dict[str, Any]:
    configure_logging("bench-console", level="WARNING")
    with tempfile.TemporaryDirectory(prefix="gpuaas-bench-console-") as run_dir:
        pg = PostgresServer(Path(run_dir) / "pg").start()
        try:
            conn = await asyncpg.connect(pg.dsn)
            await apply_migrations(conn, SCHEMA, "gpuaas_ops_view.migrations")
            await conn.close()
            started = time.perf_counter()
            one = await _fill(pg.dsn, allocations, hosts)
            filled_s = time.perf_counter() - started
            pool = await create_pool(pg.dsn, SCHEMA)
            return await _run(pool, one, requests, allocations, hosts, filled_s)
        finally:
            pg.stop()


async def _run(
    pool: asyncpg.Pool, one: uuid.UUID, requests: int, allocations: int, hosts: int, filled_s: float
) -> dict[str, Any]:
    server: list[float] = []

    @web.middleware
    async def timed(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        start = time.perf_counter()
        try:
            return await handler(request)
        finally:
            server.append(time.perf_counter() - start)

    async def no_state() -> dict[str, tuple[int, int] | None]:
        return {}

    changes = Changes(pool)
    api = ops_api(
        pool,
        SecretStr(TOKEN),
        no_state,
        Console(pool, changes, SchedulerAdmin(None, None)),
        login_secret=SecretStr(LOGIN_SECRET),
    )
    app = api.app()
    app.middlewares.insert(0, timed)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    out: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            async with http.get(login_link(url, LOGIN_SECRET, "ops", "bench")) as resp:
                assert resp.status == 200, await resp.text()
            bearer = {"Authorization": f"Bearer {TOKEN}"}

            def get(path: str, headers: dict[str, str] | None = None) -> Callable[[], Awaitable[None]]:
                async def ask() -> None:
                    async with http.get(f"{url}{path}", headers=headers) as resp:
                        body = await resp.read()
                        assert resp.status == 200, body[:500]

                return ask

            def direct(fn: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
                async def ask() -> None:
                    async with pool.acquire() as conn:
                        await fn(conn)

                return ask

            cases = {
                "allocations, first page": (
                    "/console/allocations",
                    "/v1/allocations",
                    lambda c: queries.list_allocations(c, {}),
                ),
                "allocations of a tenant, active": (
                    "/console/allocations?tenant=tenant-5&state=active",
                    "/v1/allocations?tenant=tenant-5&state=active",
                    lambda c: queries.list_allocations(c, {"tenant": "tenant-5", "state": "active"}),
                ),
                "allocation detail": (
                    f"/console/allocations/{one}",
                    f"/v1/allocations/{one}",
                    lambda c: queries.get_allocation(c, str(one)),
                ),
                "fleet, first page": ("/console/fleet", "/v1/hosts", lambda c: queries.list_hosts(c, {})),
                "usage of the month": (
                    f"/console/usage?month={month}",
                    f"/v1/usage?month={month}",
                    lambda c: queries.usage(c, {"month": month}),
                ),
            }
            for name, (page, route, read) in cases.items():
                out[name] = {
                    "page": await _measure(requests, get(page), server),
                    "api": await _measure(requests, get(route, bearer), server),
                    "query": await _measure(requests, direct(read), None),
                }
                out[name]["page_over_query"] = round(
                    out[name]["page"]["p50_ms"] / max(out[name]["query"]["p50_ms"], 1e-6), 2
                )
    finally:
        await runner.cleanup()
        await pool.close()
    worst = max(case["page"]["p95_ms"] for case in out.values())
    return {
        "allocations": allocations,
        "hosts": hosts,
        "requests_per_case": requests,
        "fill_s": round(filled_s, 1),
        "goal_ms": GOAL_MS,
        "worst_page_p95_ms": worst,
        "within_goal": worst <= GOAL_MS,
        "cases": out,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocations", type=int, default=10_000)
    parser.add_argument("--hosts", type=int, default=1_000)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = asyncio.run(main(args.allocations, args.hosts, args.requests))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['allocations']} allocations, {report['hosts']} hosts; server time, p50 / p95 ms "
            f"(goal: first page <= {GOAL_MS:.0f} ms)"
        )
        print(f"{'case':34s} {'page':>17s} {'api (JSON)':>17s} {'query only':>17s}  page/query")
        for name, c in report["cases"].items():
            cells = [f"{c[k]['p50_ms']:7.1f} / {c[k]['p95_ms']:7.1f}" for k in ("page", "api", "query")]
            print(f"{name:34s} {cells[0]:>17s} {cells[1]:>17s} {cells[2]:>17s}  {c['page_over_query']:>6.2f}")
        print(f"worst page p95 {report['worst_page_p95_ms']} ms: {'within' if report['within_goal'] else 'OVER'} goal")
