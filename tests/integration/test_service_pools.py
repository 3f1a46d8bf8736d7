"""The settings every service's database pool runs with (gpuaas_common.db.create_pool)."""

from __future__ import annotations

from gpuaas_common.db import create_pool


async def test_a_services_pool_keeps_to_its_schema_and_never_jit_compiles(fresh_db) -> None:
    # JIT compiles a costly statement at every execution: the scheduler's why-not read of 5,000 nodes took
    # 1.5-1.8 s with it, 0.27-0.40 s without (see create_pool).
    pool = await create_pool(fresh_db, "scheduler", min_size=1, max_size=1)
    try:
        async with pool.acquire() as conn:
            assert await conn.fetchval("SHOW jit") == "off"
            assert await conn.fetchval("SHOW search_path") == "scheduler"
            assert await conn.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
    finally:
        await pool.close()
