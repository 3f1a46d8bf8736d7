"""asyncpg pool bound to one service's schema."""

from __future__ import annotations

import re
import uuid
from datetime import date, datetime

import asyncpg

_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# What a Postgres restart or failover looks like to an open connection or a new one, including a pooled
# connection caught mid-operation ("cannot switch to state …"; CI saw it kill the outbox relay).
CONNECTION_LOST: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,  # admin shutdown, cannot connect now (starting up)
    asyncpg.InternalClientError,
    OSError,  # ConnectionError included
    TimeoutError,
)

# What a background loop (sweeps, lease renewals, pollers) logs and tries again at its next beat instead of dying
# with its service: a lost connection, or a statement that failed while the database was going away.
DB_UNAVAILABLE: tuple[type[BaseException], ...] = (*CONNECTION_LOST, asyncpg.PostgresError)


def check_dsn(dsn: str) -> str:
    """A Postgres URL, possibly naming several servers (`postgresql://u:p@h1:5432,h2:5432/db?target_session_attrs=
    read-write`: asyncpg tries them in order and keeps the first that matches the attrs, so a promoted standby
    is found after a failover). Errors never quote the password."""
    scheme, sep, rest = dsn.partition("://")
    if not sep or scheme not in ("postgres", "postgresql"):
        raise ValueError("database_url must be a postgresql:// URL")
    hosts = rest.split("/", 1)[0].split("?", 1)[0].rsplit("@", 1)[-1]
    for host in filter(None, hosts.split(",")):
        tail = host.rsplit("]", 1)[-1] if host.startswith("[") else host  # after an IPv6 literal: ":port" or ""
        port = tail.rpartition(":")[2] if ":" in tail else None
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"database_url: bad port in host {host!r}")
    return dsn


def text_literal(value: str) -> str:
    """`value` as a Postgres string constant, for the few statements sent as one simple query (several
    statements in one round trip: asyncpg does not pipeline, and a simple query takes no parameters).
    An E'' constant reads backslashes as escapes whatever `standard_conforming_strings` says, so doubling
    every backslash and every quote leaves nothing in the value that could end the constant."""
    if "\x00" in value:
        raise ValueError("a Postgres string cannot hold a NUL character")
    return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def value_literal(value: object) -> str:
    """`value` as a constant for a column in a simple query's INSERT or UPDATE: NULL, or its text form in a
    `text_literal`, which Postgres leaves untyped until it meets the column and then reads with the column type's
    input function -- as it reads a parameter sent as text. The one way values reach a statement without
    parameters besides the two above (an allocation's save rides on its unit of work's COMMIT: see
    `unit_of_work.WritesAtCommit`); tests/integration/test_sql_literals.py checks every type against binding.
    Everything is quoted, negative numbers too, so no constant can run into a `--` comment."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, str, uuid.UUID)):
        text = str(value)
    elif isinstance(value, float):
        text = repr(value)  # the shortest text that reads back as the same double
    elif isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("a naive datetime has no one meaning as timestamptz")
        text = value.isoformat()
    elif isinstance(value, date):
        text = value.isoformat()
    else:
        raise TypeError(f"no literal for a {type(value).__name__}: send it as a parameter")
    return text_literal(text)


def bytea_literal(value: bytes) -> str:
    """`value` as a bytea expression for a simple query: hex digits only, nothing to escape."""
    return f"decode('{value.hex()}', 'hex')"


def check_schema(schema: str) -> str:
    if not _SCHEMA_RE.match(schema):
        raise ValueError(f"invalid schema name {schema!r}")
    return schema


async def _keep_session(conn: asyncpg.Connection) -> None:
    """What a pooled connection needs on release beyond what asyncpg always does (end an open transaction,
    drop listeners): nothing, because no code leaves session state on a pooled connection -- units of work
    are transactions, LISTEN and long-held locks have connections of their own (outbox relay), and the few
    session advisory locks (migrations, retention sweep) are unlocked in a `finally`. asyncpg's default would
    send `SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL` on every release: one more
    round trip per message handled."""


# Schemas whose pooled connections reuse one generic plan per prepared statement. Placement's candidate query
# over the node table costs Postgres about 0.5 ms to plan and 0.07 ms to run; left to itself Postgres keeps
# planning it again on every execution (its custom plans look cheaper than the generic one), which made
# planning the largest single cost of a placement: `bench/scheduler.py --nodes 5000` went from 818 to
# 1,164 placements/s with 4 workers, from 367 to 633/s with one. The scheduler's statements name their
# status values as literals, so its partial indexes still apply to a generic plan. Other services keep
# Postgres's own choice until a benchmark says otherwise.
GENERIC_PLAN_SCHEMAS = frozenset({"scheduler"})


class BackendPids:
    """The server process ids of a pool's open connections: the backends whose commits the service's outbox
    relay may take rows from (`OutboxRelay(writers=...)`). A pid leaves the set when its connection closes, so a
    backend that a later session gets the same pid for is not mistaken for ours."""

    def __init__(self) -> None:
        self._pids: set[int] = set()

    def __contains__(self, pid: object) -> bool:
        return pid in self._pids

    def __len__(self) -> int:
        return len(self._pids)

    async def register(self, conn: asyncpg.Connection) -> None:
        """A pool's `init`: called once for each connection the pool opens."""
        pid = conn.get_server_pid()
        self._pids.add(pid)
        conn.add_termination_listener(lambda _conn: self._pids.discard(pid))


# A service's pool at most (create_pool's default); what each role's CONNECTION LIMIT is sized from (pg_roles).
POOL_MAX_SIZE = 10


async def create_pool(
    dsn: str, schema: str, min_size: int = 2, max_size: int = POOL_MAX_SIZE, *, writers: BackendPids | None = None
) -> asyncpg.Pool:
    """`writers` learns the backend pid of every connection the pool opens (see BackendPids)."""
    check_schema(schema)
    # search_path pins every unqualified table to the owning service's schema, so one service's
    # SQL cannot reach another's tables by accident.
    # No JIT: Postgres compiles a statement whose estimated cost passes jit_above_cost at every execution (a
    # cached plan keeps no compiled code), and the services' statements are short. The scheduler's why-not read
    # of 5,000 nodes took 1.5-1.8 s with it, 0.27-0.40 s without.
    settings = {"search_path": schema, "application_name": f"gpuaas-{schema}", "jit": "off"}
    if schema in GENERIC_PLAN_SCHEMAS:
        settings["plan_cache_mode"] = "force_generic_plan"
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        server_settings=settings,
        reset=_keep_session,
        init=writers.register if writers is not None else None,
    )
    assert pool is not None
    return pool
