"""The stack's databases: one Postgres database and one login role per Postgres-backed service
(gpuaas_common.pg_roles), with fresh passwords each start."""

from __future__ import annotations

import secrets

from gpuaas_common.pg_roles import SERVICE_ROLES, ensure_service_roles, service_database, with_database

from .coroutines import run_coro

# The prefix of every service's database: gpuaas_allocator, gpuaas_scheduler, ...
DATABASE = "gpuaas"


def create_service_roles(admin_dsn: str) -> dict[str, str]:
    """One database and login role per Postgres-backed service, fresh passwords; service -> its DSN, password
    inside."""
    passwords = {service: secrets.token_hex(24) for service in SERVICE_ROLES}
    return run_coro(lambda: ensure_service_roles(admin_dsn, DATABASE, passwords))


def service_admin_dsns(admin_dsn: str) -> dict[str, str]:
    """The superuser's DSN on each service's database, for tests and tools that read every service's tables."""
    return {service: with_database(admin_dsn, service_database(DATABASE, service)) for service in SERVICE_ROLES}


def database_env(name: str, service_dsns: dict[str, str]) -> dict[str, str]:
    # Only the services with a role get a DSN: the node agent and the simulator need no database.
    return {"GPUAAS_DATABASE_URL": service_dsns[name]} if name in service_dsns else {}
