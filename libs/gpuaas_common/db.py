"""asyncpg pool bound to one service's schema."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import re
import uuid

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


def bytea_literal(value: bytes) -> str:
    """`value` as a bytea expression for a simple query: hex digits only, nothing to escape."""
    return f"decode('{value.hex()}', 'hex')"


class NoLiteral(TypeError):
    """A value `sql_literal` does not render: the caller sends its statement with parameters instead."""


def sql_literal(value: object) -> str:
    """`value` as a constant for a statement sent without parameters (written behind and sent with the next
    statement or the COMMIT): NULL, a boolean, a finite number (int, float, Decimal), or a string constant
    that Postgres converts to the column's type as it would a parameter (text, uuid, json/jsonb from a dict
    or list, timestamptz from an aware datetime). Anything else raises NoLiteral, never a guess: a naive
    datetime would be read in the session's time zone."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return _number(str(int(value)))  # an int subclass (an enum) renders as its number, never as its name
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NoLiteral(f"{value!r} has no literal here")
        if value == 0 and math.copysign(1.0, value) < 0:
            # A numeric constant has no negative zero; a float8 one keeps the sign a parameter would.
            return "'-0.0'::float8"
        return _number(repr(value))
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise NoLiteral(f"{value!r} has no literal here")
        return _number(str(value))
    if isinstance(value, str):
        if "\x00" in value:
            raise NoLiteral("a NUL character")  # sent as a parameter, it fails the way it always did
        return text_literal(value)
    if isinstance(value, uuid.UUID):
        return f"'{value}'"
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise NoLiteral("a naive datetime")
        try:
            # In UTC: Postgres reads no fraction of a second in an offset, which Python allows.
            utc = value.astimezone(datetime.timezone.utc)
        except OverflowError:
            raise NoLiteral("a datetime whose UTC time Python cannot hold") from None  # nor can asyncpg
        return f"'{utc.isoformat()}'"
    if isinstance(value, (dict, list)):
        return text_literal(json.dumps(value))
    raise NoLiteral(f"no literal for a {type(value).__name__}")


def _number(text: str) -> str:
    # Bare, a negative number after a minus (`a -$1` with -3) would read `a --3`: the rest of the line a comment.
    # In parentheses it is one operand wherever it lands, before a cast too (`-3::text` negates a text).
    return f"({text})" if text.startswith("-") else text


# A `$n` parameter and the cast that follows it, if any (`$4::text[]`).
_PARAMETER = re.compile(r"\$(\d+)(::[a-z_]+(?:\[\])?)?")


def bind_literals(sql: str, *args: object) -> str:
    """`sql` with each `$n` replaced by `args[n-1]` as a constant (`sql_literal`), for a statement sent
    without parameters: written behind, or several sent as one simple query. A parameter cast to an array
    (`$4::text[]`) takes a list or tuple and becomes `ARRAY[…]` of its elements' literals. Raises NoLiteral
    when a value has no literal; `sql` must hold no `$` outside its parameters.

    Postgres parses and plans a constant statement every time it is sent: worth it for a statement that is
    cheap to plan (an UPDATE by primary key), not for a complex one. The scheduler's slot move (a CTE of
    three statements) cost Postgres 205 us of CPU as a constant and 30 us prepared, more than the round trip
    it saved on the client."""

    def literal(match: re.Match[str]) -> str:
        index = int(match.group(1)) - 1
        if not 0 <= index < len(args):
            raise NoLiteral(f"${index + 1} has no value")
        value, cast = args[index], match.group(2) or ""
        if cast.endswith("[]") and value is not None:
            if not isinstance(value, (list, tuple)):
                raise NoLiteral(f"${index + 1} is cast to an array but is a {type(value).__name__}")
            return f"ARRAY[{', '.join(sql_literal(v) for v in value)}]{cast}"
        return sql_literal(value) + cast

    return _PARAMETER.sub(literal, sql)


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


async def create_pool(
    dsn: str, schema: str, min_size: int = 2, max_size: int = 10, *, writers: BackendPids | None = None
) -> asyncpg.Pool:
    """`writers` learns the backend pid of every connection the pool opens (see BackendPids)."""
    check_schema(schema)
    # search_path pins every unqualified table to the owning service's schema, so one service's
    # SQL cannot reach another's tables by accident.
    settings = {"search_path": schema, "application_name": f"gpuaas-{schema}"}
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
