"""The stack's database: one Postgres database, and one login role per Postgres-backed service
(gpuaas_common.pg_roles) with fresh passwords each start."""

from __future__ import annotations

import secrets
import urllib.parse

from gpuaas_common.pg_roles import SERVICE_ROLES, ensure_service_roles

from .coroutines import run_coro

DATABASE = "gpuaas"


async def _create_database(admin_dsn: str, name: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(admin_dsn)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    parts = urllib.parse.urlsplit(admin_dsn)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))


def create_database(admin_dsn: str) -> str:
    """Create the stack's database if missing; the superuser's DSN for it."""
    return run_coro(lambda: _create_database(admin_dsn, DATABASE))


def create_service_roles(admin_dsn: str) -> dict[str, str]:
    """One login role per Postgres-backed service, fresh passwords; service -> its DSN, password inside."""
    passwords = {service: secrets.token_hex(24) for service in SERVICE_ROLES}
    return run_coro(lambda: ensure_service_roles(admin_dsn, DATABASE, passwords))


def database_env(name: str, service_dsns: dict[str, str]) -> dict[str, str]:
    # Only the services with a role get a DSN: the node agent and the simulator need no database.
    return {"GPUAAS_DATABASE_URL": service_dsns[name]} if name in service_dsns else {}
