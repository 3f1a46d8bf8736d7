"""asyncpg pool bound to one service's schema."""

from __future__ import annotations

import re

import asyncpg

_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check_schema(schema: str) -> str:
    if not _SCHEMA_RE.match(schema):
        raise ValueError(f"invalid schema name {schema!r}")
    return schema


async def create_pool(dsn: str, schema: str, min_size: int = 2, max_size: int = 10) -> asyncpg.Pool:
    check_schema(schema)
    # search_path pins every unqualified table to the owning service's schema, so one service's
    # SQL cannot reach another's tables by accident.
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        server_settings={"search_path": schema, "application_name": f"gpuaas-{schema}"},
    )
    assert pool is not None
    return pool
