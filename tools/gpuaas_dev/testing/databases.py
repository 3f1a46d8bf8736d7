"""Superuser access to every service's database, for tests, benchmarks and checkers that read the services'
tables directly (never through the services).

Each service has a database of its own (gpuaas_common.pg_roles), with its schema of the same name inside, so
`scheduler.nodes` still names the scheduler's table, but only on the scheduler's database. `ServiceDatabases`
sends each statement to the database of the one service schema it names; a statement naming two cannot run on
any database, and is refused here rather than failing there with "relation does not exist": join in Python.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import asyncpg

from gpuaas_common.pg_roles import SERVICE_ROLES

_SERVICE_OF_SCHEMA = {spec.schema: service for service, spec in SERVICE_ROLES.items()}
# A schema-qualified name: the schema not preceded by a word character or a dot (`gpuaas.scheduler.x` in a
# string constant is no table), then a dot and a name.
_QUALIFIED = re.compile(r"(?<![\w.\"])\"?(" + "|".join(map(re.escape, _SERVICE_OF_SCHEMA)) + r")\"?\.[a-z_\"]")


def service_of(sql: str) -> str:
    """The service whose database `sql` must run on: the one whose schema it names."""
    named = {_SERVICE_OF_SCHEMA[m.group(1)] for m in _QUALIFIED.finditer(sql)}
    if len(named) != 1:
        what = "no service schema" if not named else f"the schemas of {sorted(named)}, each in its own database"
        raise ValueError(f"the statement names {what}: {sql[:120]!r}")
    return named.pop()


class ServiceDatabases:
    """One small superuser pool per service database; `fetch`/`fetchval`/`fetchrow`/`execute` route by schema."""

    def __init__(self, pools: Mapping[str, asyncpg.Pool]) -> None:
        self.pools = dict(pools)

    @classmethod
    async def open(cls, dsns: Mapping[str, str], min_size: int = 1, max_size: int = 4) -> ServiceDatabases:
        pools: dict[str, asyncpg.Pool] = {}
        try:
            for service, dsn in dsns.items():
                pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size)
                assert pool is not None
                pools[service] = pool
        except BaseException:
            for pool in pools.values():
                await pool.close()
            raise
        return cls(pools)

    def pool(self, service: str) -> asyncpg.Pool:
        return self.pools[service]

    async def fetch(self, sql: str, *args: Any, **kwargs: Any) -> list[asyncpg.Record]:
        return await self.pools[service_of(sql)].fetch(sql, *args, **kwargs)

    async def fetchrow(self, sql: str, *args: Any, **kwargs: Any) -> asyncpg.Record | None:
        return await self.pools[service_of(sql)].fetchrow(sql, *args, **kwargs)

    async def fetchval(self, sql: str, *args: Any, **kwargs: Any) -> Any:
        return await self.pools[service_of(sql)].fetchval(sql, *args, **kwargs)

    async def execute(self, sql: str, *args: Any, **kwargs: Any) -> str:
        return await self.pools[service_of(sql)].execute(sql, *args, **kwargs)

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()

    async def __aenter__(self) -> ServiceDatabases:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()
