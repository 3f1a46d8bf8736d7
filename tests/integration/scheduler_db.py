"""A migrated scheduler schema and its admin API, shared by the scheduler's integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from gpuaas_common.migrations import apply_migrations
from gpuaas_scheduler.entrypoints.admin_http import build_app

ADMIN_TOKEN = "test-admin-token"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@asynccontextmanager
async def scheduler_pool(dsn: str, max_size: int = 4) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size, server_settings={"search_path": "scheduler"})
    assert pool is not None
    try:
        async with pool.acquire() as conn:
            await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
        yield pool
    finally:
        await pool.close()


@asynccontextmanager
async def admin_client(pool: asyncpg.Pool) -> AsyncIterator[TestClient]:
    client = TestClient(TestServer(build_app(pool, SecretStr(ADMIN_TOKEN)), host="127.0.0.1"))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
