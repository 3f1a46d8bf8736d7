"""Forward-only SQL migrations, one schema per service.

Files `NNN_name.sql` in the service's `migrations` package are applied in order, each in its own
transaction, under an advisory lock so that two replicas starting together do not race.
"""

from __future__ import annotations

import importlib.resources

import asyncpg

from .db import check_schema
from .logging import get_logger

log = get_logger(__name__)

# The outbox and inbox live in every Postgres-backed service's own schema.
COMMON_MIGRATIONS: tuple[tuple[str, str], ...] = (
    (
        "000_outbox_inbox",
        """
        CREATE TABLE outbox (
            id           bigserial PRIMARY KEY,
            event_id     text NOT NULL UNIQUE,
            aggregate_id text NOT NULL,
            subject      text NOT NULL,
            body         bytea NOT NULL,
            created_at   timestamptz NOT NULL DEFAULT now(),
            attempts     integer NOT NULL DEFAULT 0,
            last_error   text
        );
        CREATE TABLE inbox (
            consumer    text NOT NULL,
            message_id  text NOT NULL,
            received_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (consumer, message_id)
        );
        """,
    ),
    # The retention sweep (retention.py) finds expired rows by age.
    ("000_inbox_received_at", "CREATE INDEX inbox_received_at ON inbox (received_at);"),
    # A host-fed consumer's rows name their node and their place among its rows (`node_seq`: 1, 2, ...), and each
    # (consumer, node) keeps its newest `keep` (inbox.claim_statement). The claim's trim lives in a function so its
    # statements are planned once a connection, not at every message. The columns have no default, so adding them
    # rewrites nothing; the index holds host-fed rows only.
    (
        "000_inbox_node",
        """
        ALTER TABLE inbox ADD COLUMN node_id text, ADD COLUMN node_seq bigint;
        CREATE INDEX inbox_node ON inbox (consumer, node_id, node_seq) WHERE node_id IS NOT NULL;
        CREATE FUNCTION inbox_node_seq(p_consumer text, p_message_id text, p_node_id text, p_keep integer)
        RETURNS bigint LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
        DECLARE
            next_seq bigint;
        BEGIN
            -- The group's turn, to the commit: the statements below see every earlier claim of it committed.
            PERFORM pg_advisory_xact_lock(hashtext(p_consumer), hashtext(p_node_id));
            SELECT coalesce(max(node_seq), 0) + 1 INTO next_seq
              FROM inbox WHERE consumer = p_consumer AND node_id = p_node_id;
            IF NOT EXISTS (SELECT 1 FROM inbox WHERE consumer = p_consumer AND message_id = p_message_id) THEN
                DELETE FROM inbox
                 WHERE consumer = p_consumer AND node_id = p_node_id AND node_seq = next_seq - p_keep;
            END IF;
            RETURN next_seq;
        END
        $$;
        """,
    ),
)


class MigrationError(RuntimeError):
    """One migration failed and was rolled back; those before it stay applied."""

    def __init__(self, schema: str, version: str, cause: asyncpg.PostgresError) -> None:
        super().__init__(f"migration {schema}/{version} failed: {type(cause).__name__}: {cause}")
        self.schema, self.version = schema, version


def service_migrations(package: str) -> list[tuple[str, str]]:
    files = importlib.resources.files(package)
    found = sorted(
        (entry.name.removesuffix(".sql"), entry.read_text()) for entry in files.iterdir() if entry.name.endswith(".sql")
    )
    return found


async def apply_migrations(conn: asyncpg.Connection, schema: str, package: str | None) -> list[str]:
    check_schema(schema)
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock(hashtext($1))", f"gpuaas-migrations:{schema}")
    try:
        # Not CREATE SCHEMA IF NOT EXISTS: Postgres checks the database's CREATE privilege before it looks,
        # and a service role has none; its schema is made for it (pg_roles.py), migrations only fill it.
        if not await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema):
            await conn.execute(f'CREATE SCHEMA "{schema}"')
        await conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}".schema_migrations '
            "(version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch(f'SELECT version FROM "{schema}".schema_migrations')}
        todo = list(COMMON_MIGRATIONS) + (service_migrations(package) if package else [])
        for version, sql in todo:
            if version in done:
                continue
            try:
                async with conn.transaction():
                    await conn.execute(f'SET LOCAL search_path TO "{schema}"')
                    await conn.execute(sql)
                    await conn.execute(f'INSERT INTO "{schema}".schema_migrations (version) VALUES ($1)', version)
            except asyncpg.PostgresError as exc:
                raise MigrationError(schema, version, exc) from exc
            applied.append(version)
            log.info("migration_applied", schema=schema, version=version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", f"gpuaas-migrations:{schema}")
    return applied
