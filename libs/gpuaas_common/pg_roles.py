"""One Postgres database and one login role per Postgres-backed service: the role owns that service's schema
in that database and may connect to no other database.

Each service connects as its own role, so a bug or a compromised process in one service cannot read or
change another's tables: the role owns its schema (its migrations run as it) and holds no privilege on
the database beyond CONNECT and TEMPORARY, or in `public`. Only this module needs the admin (superuser) DSN.

Why a database each and not a schema each in one database: Postgres checks no privilege on NOTIFY, LISTEN or
advisory locks, and all three are scoped to a database. In a shared database any service's role could NOTIFY
another service's outbox relay a row to publish under that service's bus identity, LISTEN to every service's
events, or take another relay's advisory lock. Only CONNECT, which Postgres does check, separates them: a role
that cannot connect to the allocator's database cannot reach its channels or its locks. The schema keeps its
name inside the service's database, so `search_path`, migrations and schema-qualified SQL stay as they were.

    dsns = await ensure_service_roles(admin_dsn, "gpuaas", {"allocator": pw1, "scheduler": pw2, ...})
    dsns["allocator"]   # postgresql://gpuaas_allocator:<pw1>@<admin host:port>/gpuaas_allocator

Passwords reach the server only as SCRAM-SHA-256 verifiers computed here, so the plaintext never shows
up in a server log or `pg_stat_statements`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import asyncpg

from .db import POOL_MAX_SIZE
from .logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class ServiceRole:
    role: str
    schema: str


# The schemas are the ones each service passes to `run_service(..., schema=...)`; a test holds them equal.
# node-agent keeps host-local state and has no role.
SERVICE_ROLES: Mapping[str, ServiceRole] = MappingProxyType(
    {
        "allocator": ServiceRole("gpuaas_allocator", "allocator"),
        "scheduler": ServiceRole("gpuaas_scheduler", "scheduler"),
        "image-pipeline": ServiceRole("gpuaas_image_pipeline", "image_pipeline"),
        "maas-gateway": ServiceRole("gpuaas_maas_gateway", "maas_gateway"),
        "ops-view": ServiceRole("gpuaas_ops_view", "ops_view"),
    }
)

_ROLE_ATTRIBUTES = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION NOBYPASSRLS"
# Roles and databases are cluster-wide and advisory locks per database: the lock is taken in the admin DSN's
# database, which every init step of one deployment names (two of them racing on CREATE ROLE or DATABASE).
_LOCK_KEY = "gpuaas-pg-roles"
_SCRAM_ITERATIONS = 4096
_PRINTABLE_ASCII = re.compile(r"^[\x21-\x7e]+$")


# Connections a replica opens besides its pool: the outbox relay's listener, a service's own listener (ops-view's
# console changes), and one to spare for a reconnect that overlaps the old session's end.
DEDICATED_CONNECTIONS = 3
# Replicas a role's connection limit leaves room for by default (`gpuaas dev pg-roles --replicas`).
DEFAULT_REPLICAS = 4


def role_connection_limit(replicas: int = DEFAULT_REPLICAS) -> int:
    """A role's CONNECTION LIMIT: every replica's pool and dedicated connections, so that one service (a leak, a
    compromised process) cannot take the cluster's max_connections from the others."""
    if replicas < 1:
        raise ValueError("a service has at least one replica")
    return replicas * (POOL_MAX_SIZE + DEDICATED_CONNECTIONS)


def service_database(prefix: str, service: str) -> str:
    """The database of `service` in a deployment whose databases start with `prefix` (`gpuaas_allocator`)."""
    return f"{prefix}_{SERVICE_ROLES[service].schema}"


async def ensure_service_roles(
    admin_dsn: str,
    prefix: str,
    passwords: Mapping[str, str],
    *,
    replicas: int = DEFAULT_REPLICAS,
    connection_limit: int | None = None,
) -> dict[str, str]:
    """Create or update the database, role and schema of every service in `passwords`; return each service's DSN.

    Each role gets a CONNECTION LIMIT: `connection_limit`, else `role_connection_limit(replicas)`.

    Each service gets the database `service_database(prefix, service)`. Idempotent: a second call only sets the
    (possibly new) passwords and re-asserts ownership and revocations. An existing schema, and the tables,
    views and sequences in it, change owner to the role (the services define no functions or types), so a
    database that predates the roles is adopted.
    """
    unknown = set(passwords) - set(SERVICE_ROLES)
    if unknown:
        raise ValueError(f"no Postgres role is defined for {sorted(unknown)}; known: {sorted(SERVICE_ROLES)}")
    for service, password in passwords.items():
        _check_password(service, password)
    limit = role_connection_limit(replicas) if connection_limit is None else connection_limit
    if limit < 1:
        raise ValueError("a role's connection limit must be at least 1")
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute("SELECT pg_advisory_lock(hashtext($1))", _LOCK_KEY)
        for service, password in passwords.items():
            spec = SERVICE_ROLES[service]
            async with admin.transaction():
                await _ensure_role(admin, spec.role, password, limit)
            database = service_database(prefix, service)
            # CREATE DATABASE cannot run in a transaction; the lock keeps a racing init step out.
            if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database):
                await _run_formatted(admin, "CREATE DATABASE %I", database)
                log.info("pg_database_created", database=database)
            conn = await asyncpg.connect(with_database(admin_dsn, database))
            try:
                async with conn.transaction():
                    await _lock_down_database(conn, database, spec.role)
                    await _ensure_schema(conn, spec)
                    await _close_foreign_schemas(conn)
            finally:
                await conn.close()
    finally:
        await admin.close()  # ends the session, and with it the lock
    log.info("pg_roles_ensured", prefix=prefix, services=sorted(passwords))
    return {
        service: role_dsn(admin_dsn, service_database(prefix, service), SERVICE_ROLES[service].role, password)
        for service, password in passwords.items()
    }


def role_dsn(admin_dsn: str, database: str, role: str, password: str) -> str:
    """The admin DSN's hosts, ports and query (e.g. sslmode, target_session_attrs), with this role, password and
    database. The host part is kept as written: it may list several servers (`h1:5432,h2:5432`)."""
    parts = urllib.parse.urlsplit(admin_dsn)
    hosts = parts.netloc.rsplit("@", 1)[-1] or "127.0.0.1"
    netloc = f"{urllib.parse.quote(role, safe='')}:{urllib.parse.quote(password, safe='')}@{hosts}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, path=f"/{database}"))


def dsn_without_password(dsn: str) -> str:
    """For places that must not hold secrets (stack.json, logs)."""
    parts = urllib.parse.urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}@{netloc}"))


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = _SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier Postgres stores for `password` (RFC 5802/7677, Postgres' text form).

    SASLprep is the identity for the printable ASCII that `_check_password` admits, so the server and
    any client derive the same keys from it.
    """
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _check_password(service: str, password: str) -> None:
    if not password:
        raise ValueError(f"empty Postgres password for {service}")
    if not _PRINTABLE_ASCII.match(password):
        raise ValueError(f"the Postgres password for {service} must be printable ASCII without spaces")


def with_database(dsn: str, database: str) -> str:
    """`dsn` with its database replaced (hosts, user and query kept)."""
    return urllib.parse.urlunsplit(urllib.parse.urlsplit(dsn)._replace(path=f"/{database}"))


async def _run_formatted(conn: asyncpg.Connection, template: str, *args: str) -> None:
    # DDL takes no bind parameters; the server's own format() quotes identifiers (%I) and literals (%L).
    placeholders = ", ".join(f"${i}::text" for i in range(2, len(args) + 2))
    statement = await conn.fetchval(f"SELECT format($1::text, {placeholders})", template, *args)
    await conn.execute(statement)


async def _lock_down_database(conn: asyncpg.Connection, database: str, role: str) -> None:
    # PUBLIC gets CONNECT and TEMPORARY on a new database by default; only the owning service's role gets them
    # back, by name, and a grant made by hand to another service's role is taken back: connecting is the one
    # check that keeps a role away from this database's NOTIFY channels and advisory locks.
    # TEMPORARY: session-private tables that no other role can see; migrations use them to backfill
    # (scheduler 004). Before Postgres 15 PUBLIC could also create in schema public.
    await _run_formatted(conn, "REVOKE ALL ON DATABASE %I FROM PUBLIC", database)
    for other in await conn.fetch(
        "SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[]) AND rolname <> $2",
        [s.role for s in SERVICE_ROLES.values()],
        role,
    ):
        await _run_formatted(conn, "REVOKE ALL ON DATABASE %I FROM %I", database, other["rolname"])
    await _run_formatted(conn, "GRANT CONNECT, TEMPORARY ON DATABASE %I TO %I", database, role)
    if await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = 'public'"):
        await conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")


async def _ensure_role(conn: asyncpg.Connection, role: str, password: str, limit: int) -> None:
    exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role)
    verb = "ALTER" if exists else "CREATE"
    await _run_formatted(
        conn,
        f"{verb} ROLE %I WITH {_ROLE_ATTRIBUTES} CONNECTION LIMIT %s PASSWORD %L",
        role,
        str(int(limit)),
        scram_verifier(password),
    )
    # A membership granted by hand would let the role SET ROLE into another's rights.
    for granted in await conn.fetch(
        "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member "
        "JOIN pg_roles g ON g.oid = m.roleid WHERE r.rolname = $1",
        role,
    ):
        await _run_formatted(conn, "REVOKE %I FROM %I", granted["rolname"], role)


async def _ensure_schema(conn: asyncpg.Connection, spec: ServiceRole) -> None:
    row = await conn.fetchrow(
        "SELECT n.nspowner = r.oid AS owned FROM pg_namespace n, pg_roles r WHERE n.nspname = $1 AND r.rolname = $2",
        spec.schema,
        spec.role,
    )
    if row is None:
        await _run_formatted(conn, "CREATE SCHEMA %I AUTHORIZATION %I", spec.schema, spec.role)
        log.info("pg_schema_created", schema=spec.schema, role=spec.role)
        return
    if not row["owned"]:
        await _run_formatted(conn, "ALTER SCHEMA %I OWNER TO %I", spec.schema, spec.role)
        log.info("pg_schema_adopted", schema=spec.schema, role=spec.role)
    # Sequences owned by a column follow their table; ALTER on them directly would be refused.
    statements = await conn.fetch(
        """
        SELECT format('ALTER %s %I.%I OWNER TO %I',
                      CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                     WHEN 'm' THEN 'MATERIALIZED VIEW' WHEN 'f' THEN 'FOREIGN TABLE'
                                     ELSE 'TABLE' END,
                      n.nspname, c.relname, r.rolname) AS stmt
        FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_roles r ON r.rolname = $2
        WHERE n.nspname = $1 AND c.relowner <> r.oid AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
          AND NOT (c.relkind = 'S' AND EXISTS (
                SELECT 1 FROM pg_depend d
                WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype IN ('a', 'i')))
        """,
        spec.schema,
        spec.role,
    )
    for row in statements:
        await conn.execute(row["stmt"])
    if statements:
        log.info("pg_relations_adopted", schema=spec.schema, role=spec.role, count=len(statements))


async def _close_foreign_schemas(conn: asyncpg.Connection) -> None:
    """Take back any privilege on a service schema held by PUBLIC or by another service's role.

    Owners never need a grant; a schema without USAGE is a closed door whatever is granted inside it.
    """
    existing_roles = {
        r["rolname"]
        for r in await conn.fetch(
            "SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[])",
            [s.role for s in SERVICE_ROLES.values()],
        )
    }
    for spec in SERVICE_ROLES.values():
        if not await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", spec.schema):
            continue
        await _run_formatted(conn, "REVOKE ALL ON SCHEMA %I FROM PUBLIC", spec.schema)
        for other in sorted(existing_roles - {spec.role}):
            await _run_formatted(conn, "REVOKE ALL ON SCHEMA %I FROM %I", spec.schema, other)
