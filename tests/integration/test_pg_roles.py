"""Per-service Postgres databases and roles against a real cluster with password authentication.

Each Postgres-backed service's role owns its schema in its own database, runs its migrations, and can neither
connect to another service's database nor read, write or create anything there; passwords are enforced and can
be rotated.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import secrets
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import asyncpg
import pytest

from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.pg_roles import (
    SERVICE_ROLES,
    ensure_service_roles,
    role_connection_limit,
    service_database,
    with_database,
)

SERVICES = sorted(SERVICE_ROLES)


def _entrypoint(service: str) -> dict[str, object]:
    """The schema and migrations package the service's own main() hands to run_service."""
    module = importlib.import_module(f"gpuaas_{service.replace('-', '_')}.entrypoints.main")
    captured: dict[str, object] = {}

    def fake_run_service(name, settings, register, **kwargs):
        captured.update(kwargs, name=name)

    original = module.run_service
    module.run_service = fake_run_service
    try:
        module.main()
    finally:
        module.run_service = original
    assert captured["name"] == service
    return captured


def _database(dsn: str) -> str:
    return urllib.parse.urlsplit(dsn).path.lstrip("/")


def _with_password(dsn: str, password: str) -> str:
    parts = urllib.parse.urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:{password}@{host}"))


def _roles() -> dict[str, str]:
    return {service: spec.role for service, spec in SERVICE_ROLES.items()}


def _password_of(dsns: dict[str, str], role: str) -> str:
    return next(
        urllib.parse.urlsplit(d).password or "" for d in dsns.values() if urllib.parse.urlsplit(d).username == role
    )


def _passwords() -> dict[str, str]:
    return {service: secrets.token_hex(16) for service in SERVICES}


@pytest.fixture
def no_ambient_password(monkeypatch, tmp_path):
    # A refusal must come from the server, not from a password asyncpg found in the environment.
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-such-pgpass"))


def _service_db(fresh_db: str, service: str) -> str:
    """The superuser's DSN on `service`'s database of the deployment named after `fresh_db`."""
    return with_database(fresh_db, service_database(_database(fresh_db), service))


@pytest.fixture
async def service_dbs(postgres_server, fresh_db) -> AsyncIterator[None]:
    """The service databases of the deployment named after `fresh_db`, dropped with it."""
    yield
    admin = await asyncpg.connect(postgres_server.dsn)
    try:
        for service in SERVICES:
            await admin.execute(
                f'DROP DATABASE IF EXISTS "{service_database(_database(fresh_db), service)}" WITH (FORCE)'
            )
    finally:
        await admin.close()


@pytest.fixture
async def role_dsns(postgres_server, fresh_db, service_dbs) -> AsyncIterator[dict[str, str]]:
    yield await ensure_service_roles(postgres_server.dsn, _database(fresh_db), _passwords())


@pytest.fixture
async def migrated(role_dsns) -> AsyncIterator[dict[str, str]]:
    for service, dsn in role_dsns.items():
        conn = await asyncpg.connect(dsn)
        try:
            await apply_migrations(conn, SERVICE_ROLES[service].schema, str(_entrypoint(service)["migrations_package"]))
        finally:
            await conn.close()
    yield role_dsns


def test_the_role_table_matches_every_services_entrypoint():
    for service in SERVICES:
        assert _entrypoint(service)["schema"] == SERVICE_ROLES[service].schema, service
    assert len({r.role for r in SERVICE_ROLES.values()}) == len(SERVICE_ROLES)


async def test_each_role_owns_its_schema_and_works_in_it(role_dsns, fresh_db):
    for service, dsn in role_dsns.items():
        spec = SERVICE_ROLES[service]
        assert urllib.parse.urlsplit(dsn).username == spec.role
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SELECT current_user") == spec.role
            await conn.execute(f'CREATE TABLE "{spec.schema}".mine (id int PRIMARY KEY, note text)')
            await conn.execute(f'INSERT INTO "{spec.schema}".mine VALUES (1, $1)', service)
            await conn.execute(f"UPDATE \"{spec.schema}\".mine SET note = note || '!'")
            assert await conn.fetchval(f'SELECT note FROM "{spec.schema}".mine') == f"{service}!"
            attrs = await conn.fetchrow(
                "SELECT rolsuper, rolcreatedb, rolcreaterole, rolinherit, rolreplication, rolbypassrls, rolcanlogin "
                "FROM pg_roles WHERE rolname = current_user"
            )
            assert dict(attrs) == {
                "rolsuper": False,
                "rolcreatedb": False,
                "rolcreaterole": False,
                "rolinherit": False,
                "rolreplication": False,
                "rolbypassrls": False,
                "rolcanlogin": True,
            }
            owner = await conn.fetchval(
                "SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = $1", spec.schema
            )
            assert owner == spec.role
        finally:
            await conn.close()


async def _as_superuser(dsn: str, *statements: str) -> None:
    """Set up what a careless operator might have done by hand before the roles were ensured."""
    admin = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await admin.execute(statement)
    finally:
        await admin.close()


async def test_roles_get_nothing_beyond_their_schema(role_dsns):
    for dsn in role_dsns.values():
        conn = await asyncpg.connect(dsn)
        try:
            for statement in ("CREATE TABLE public.squat (x int)", "CREATE SCHEMA squat"):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(statement)
            # Session-private temp tables stay allowed: migrations backfill through them.
            await conn.execute("CREATE TEMP TABLE scratch (x int)")
        finally:
            await conn.close()


async def test_other_roles_of_the_cluster_cannot_even_connect(postgres_server, fresh_db, role_dsns):
    await _as_superuser(
        fresh_db,
        "DROP ROLE IF EXISTS gpuaas_test_outsider",
        "CREATE ROLE gpuaas_test_outsider LOGIN PASSWORD 'outsider-password'",
    )
    try:
        for service in SERVICES:
            # Neither a stranger nor another service's role: only the owner's role connects to a service database.
            parts = urllib.parse.urlsplit(_service_db(fresh_db, service))
            for role in ["gpuaas_test_outsider", *(r for s, r in _roles().items() if s != service)]:
                password = "outsider-password" if role == "gpuaas_test_outsider" else _password_of(role_dsns, role)
                dsn = urllib.parse.urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.hostname}:{parts.port}"))
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await asyncpg.connect(dsn)
    finally:
        admin = await asyncpg.connect(postgres_server.dsn)
        await admin.execute("DROP ROLE gpuaas_test_outsider")
        await admin.close()


async def test_no_role_can_read_write_or_create_in_another_services_schema(migrated):
    async with AsyncExitStack() as stack:
        conns: dict[str, asyncpg.Connection] = {}
        for service, dsn in migrated.items():
            conns[service] = await asyncpg.connect(dsn)
            stack.push_async_callback(conns[service].close)
        pairs = list(itertools.permutations(SERVICES, 2))
        assert len(pairs) == len(SERVICES) * (len(SERVICES) - 1)
        allowed: list[str] = []
        for a, b in pairs:
            schema = SERVICE_ROLES[b].schema
            for statement in (
                f'SELECT count(*) FROM "{schema}".outbox',
                f"INSERT INTO \"{schema}\".inbox (consumer, message_id) VALUES ('intruder', 'm1')",
                f'CREATE TABLE "{schema}".intruder (x int)',
            ):
                try:
                    await conns[a].execute(statement)
                # In its own database a role finds no other service's schema (it lives in that service's database,
                # where the role may not connect); one created there by hand would still be closed to it.
                except (
                    asyncpg.InsufficientPrivilegeError,
                    asyncpg.UndefinedTableError,
                    asyncpg.InvalidSchemaNameError,
                ):
                    continue
                allowed.append(f"{a} may: {statement}")
        assert allowed == []


async def test_every_services_migrations_run_as_its_role(role_dsns):
    for service, dsn in role_dsns.items():
        spec = SERVICE_ROLES[service]
        package = str(_entrypoint(service)["migrations_package"])
        # As the runtime does it: a pool pinned to the schema, migrations on one of its connections.
        pool = await create_pool(dsn, spec.schema, min_size=1, max_size=1)
        try:
            async with pool.acquire() as conn:
                applied = await apply_migrations(conn, spec.schema, package)
                assert applied[0] == "000_outbox_inbox" and len(applied) > 1, (service, applied)
                assert await apply_migrations(conn, spec.schema, package) == []
                owners = {
                    r["tableowner"]
                    for r in await conn.fetch("SELECT tableowner FROM pg_tables WHERE schemaname = $1", spec.schema)
                }
                assert owners == {spec.role}, service
        finally:
            await pool.close()


async def test_ensuring_again_is_harmless_and_rotates_passwords(
    postgres_server, fresh_db, service_dbs, no_ambient_password
):
    # Roles without password checks isolate nothing: on the pgserver fallback (which trusts every
    # connection) this fails on purpose; `make setup` installs the system Postgres that enforces them.
    assert postgres_server.enforces_passwords, "this Postgres trusts every connection: roles mean nothing here"
    database = _database(fresh_db)
    passwords = _passwords()
    first = await ensure_service_roles(postgres_server.dsn, database, passwords)
    conn = await asyncpg.connect(first["allocator"])
    await conn.execute("CREATE TABLE allocator.kept (x int)")
    await conn.execute("INSERT INTO allocator.kept VALUES (7)")
    await conn.close()

    assert await ensure_service_roles(postgres_server.dsn, database, passwords) == first

    rotated = await ensure_service_roles(postgres_server.dsn, database, {**passwords, "allocator": "n3w-" + "x" * 20})
    conn = await asyncpg.connect(rotated["allocator"])
    try:
        assert await conn.fetchval("SELECT x FROM allocator.kept") == 7
    finally:
        await conn.close()
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(first["allocator"])
    # The other services' passwords were not touched.
    conn = await asyncpg.connect(rotated["scheduler"])
    await conn.close()
    assert rotated["scheduler"] == first["scheduler"]


async def test_wrong_or_missing_password_is_refused(postgres_server, role_dsns, no_ambient_password):
    # Roles without password checks isolate nothing: on the pgserver fallback (which trusts every
    # connection) this fails on purpose; `make setup` installs the system Postgres that enforces them.
    assert postgres_server.enforces_passwords, "this Postgres trusts every connection: roles mean nothing here"
    for dsn in (role_dsns["scheduler"], postgres_server.dsn):
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(_with_password(dsn, "not-the-password"))
        parts = urllib.parse.urlsplit(dsn)
        without = urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}@{parts.hostname}:{parts.port}"))
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(without)


async def test_a_schema_that_predates_the_roles_is_adopted(postgres_server, fresh_db, service_dbs):
    await _as_superuser(fresh_db, f'CREATE DATABASE "{service_database(_database(fresh_db), "scheduler")}"')
    await _as_superuser(
        _service_db(fresh_db, "scheduler"),
        "CREATE SCHEMA scheduler",
        "CREATE TABLE scheduler.legacy (id serial PRIMARY KEY, note text)",
        "CREATE VIEW scheduler.legacy_notes AS SELECT note FROM scheduler.legacy",
    )
    dsns = await ensure_service_roles(postgres_server.dsn, _database(fresh_db), _passwords())
    conn = await asyncpg.connect(dsns["scheduler"])
    try:
        # The serial's sequence moved with its table, or this insert would be refused.
        await conn.execute("INSERT INTO scheduler.legacy (note) VALUES ('old')")
        assert await conn.fetchval("SELECT note FROM scheduler.legacy_notes") == "old"
        await conn.execute("ALTER TABLE scheduler.legacy ADD COLUMN migrated bool")
    finally:
        await conn.close()


async def test_hand_granted_rights_across_services_are_taken_back(postgres_server, fresh_db, role_dsns):
    scheduler_db = service_database(_database(fresh_db), "scheduler")
    await _as_superuser(
        _service_db(fresh_db, "scheduler"),
        f'GRANT CONNECT ON DATABASE "{scheduler_db}" TO gpuaas_allocator',
        "GRANT USAGE, CREATE ON SCHEMA scheduler TO gpuaas_allocator",
        "GRANT gpuaas_image_pipeline TO gpuaas_allocator",
    )
    await ensure_service_roles(postgres_server.dsn, _database(fresh_db), _passwords())
    dsns = await ensure_service_roles(postgres_server.dsn, _database(fresh_db), {"allocator": "p" * 24})
    parts = urllib.parse.urlsplit(dsns["allocator"])
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await asyncpg.connect(urllib.parse.urlunsplit(parts._replace(path=f"/{scheduler_db}")))
    conn = await asyncpg.connect(dsns["allocator"])
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("SET ROLE gpuaas_image_pipeline")
    finally:
        await conn.close()


@pytest.mark.parametrize(
    "passwords, why",
    [
        ({"node-agent": "x" * 20}, "no Postgres role"),
        ({"allocator": ""}, "empty"),
        ({"allocator": "pässwört-pässwört"}, "printable ASCII"),
        ({"allocator": "with space inside"}, "printable ASCII"),
    ],
)
async def test_bad_input_is_refused_before_touching_the_cluster(passwords, why):
    # The admin DSN points nowhere: validation has to come first.
    with pytest.raises(ValueError, match=why):
        await ensure_service_roles("postgresql://nobody:x@127.0.0.1:1/none", "none", passwords)


def test_the_compose_init_command_creates_the_roles_and_refuses_weak_passwords(postgres_server, fresh_db, service_dbs):
    from typer.testing import CliRunner

    from gpuaas_common.pg_roles import role_dsn
    from gpuaas_dev.cli import app

    database = _database(fresh_db)
    env = {f"GPUAAS_PG_{s.upper().replace('-', '_')}_PASSWORD": secrets.token_hex(24) for s in SERVICES}
    env["GPUAAS_PG_ADMIN_DSN"] = postgres_server.dsn
    argv = ["dev", "pg-roles", "--database", database]

    weak = CliRunner().invoke(app, argv, env={**env, "GPUAAS_PG_SCHEDULER_PASSWORD": ""})
    assert weak.exit_code == 2 and "GPUAAS_PG_SCHEDULER_PASSWORD" in weak.output, weak.output

    done = CliRunner().invoke(app, argv, env=env)
    assert done.exit_code == 0, done.output
    assert not any(password in done.output for password in env.values())
    password = env["GPUAAS_PG_MAAS_GATEWAY_PASSWORD"]

    async def owner() -> str:
        where = service_database(database, "maas-gateway")
        conn = await asyncpg.connect(role_dsn(postgres_server.dsn, where, "gpuaas_maas_gateway", password))
        try:
            return await conn.fetchval(
                "SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'maas_gateway'"
            )
        finally:
            await conn.close()

    assert asyncio.run(owner()) == "gpuaas_maas_gateway"


async def test_each_role_has_a_connection_limit_it_cannot_pass(postgres_server, fresh_db, service_dbs) -> None:
    """N16/W1: without a CONNECTION LIMIT one service's role (a leak, a compromised process) could take every
    connection the cluster has from the others."""
    prefix = _database(fresh_db)
    dsns = await ensure_service_roles(postgres_server.dsn, prefix, _passwords(), connection_limit=2)
    admin = await asyncpg.connect(postgres_server.dsn)
    try:
        limits = dict(
            await admin.fetch(
                "SELECT rolname, rolconnlimit FROM pg_roles WHERE rolname = ANY($1::text[])",
                [s.role for s in SERVICE_ROLES.values()],
            )
        )
    finally:
        await admin.close()
    assert limits == {s.role: 2 for s in SERVICE_ROLES.values()}
    async with AsyncExitStack() as held:
        for _ in range(2):
            conn = await asyncpg.connect(dsns["allocator"])
            held.push_async_callback(conn.close)
        with pytest.raises(asyncpg.TooManyConnectionsError):
            await asyncpg.connect(dsns["allocator"])
        # Another service's role is not held back by the allocator's connections.
        other = await asyncpg.connect(dsns["scheduler"])
        await other.close()
    # The default: every replica's pool and its dedicated connections.
    await ensure_service_roles(postgres_server.dsn, prefix, _passwords())
    admin = await asyncpg.connect(postgres_server.dsn)
    try:
        limit = await admin.fetchval("SELECT rolconnlimit FROM pg_roles WHERE rolname = 'gpuaas_allocator'")
    finally:
        await admin.close()
    assert limit == role_connection_limit() > 10
