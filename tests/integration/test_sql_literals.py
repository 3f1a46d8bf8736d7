"""`text_literal` and `bytea_literal` render the few values sent inside a simple query (the unit of work's BEGIN
with its inbox claim and advisory lock, its COMMIT with the outbox rows): each must reach Postgres as the same
value asyncpg sends as a parameter, and nothing in a value may end its constant."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuaas_common.db import bytea_literal, text_literal, value_literal
from gpuaas_dev.testing.servers import PostgresServer

HOSTILE = "it's a \\'trap\\' $$; DROP TABLE x; -- \\x41 \u00e9\u6f22 \U0001f680"


@pytest.mark.parametrize("value", ["", HOSTILE, "\\", "'", "E'x'", "-1", "\n; --"])
async def test_a_text_literal_arrives_as_the_parameter_would(fresh_db, value) -> None:
    conn = await asyncpg.connect(fresh_db)
    try:
        # As a simple query, the way BEGIN and COMMIT carry them, with a statement after it.
        await conn.execute(f"CREATE TEMP TABLE t AS SELECT {text_literal(value)}::text AS v; SELECT 1")
        assert await conn.fetchval("SELECT v FROM t") == await conn.fetchval("SELECT $1::text", value)
    finally:
        await conn.close()


def test_a_nul_character_is_refused() -> None:
    with pytest.raises(ValueError):
        text_literal("nul\x00inside")


async def _both(conn: asyncpg.Connection, text: str, data: bytes) -> None:
    from_literals = await conn.fetchrow(f"SELECT {text_literal(text)}::text AS t, {bytea_literal(data)} AS b")
    from_params = await conn.fetchrow("SELECT $1::text AS t, $2::bytea AS b", text, data)
    assert tuple(from_literals) == tuple(from_params) == (text, data)


def test_every_literal_reads_back_as_its_parameter(postgres_server: PostgresServer) -> None:
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(asyncpg.connect(postgres_server.dsn))
    try:
        # Lone surrogates cannot be sent either way (asyncpg encodes UTF-8); NUL is refused above.
        text = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)))

        @settings(max_examples=300, deadline=None)
        @given(text, st.binary())
        def check(value: str, data: bytes) -> None:
            loop.run_until_complete(_both(conn, value, data))

        check()
    finally:
        loop.run_until_complete(conn.close())
        loop.close()


# --- value_literal: the allocator's saves, held for the COMMIT (unit_of_work.WritesAtCommit) ---------------

COLUMNS = {
    "t": "text",
    "u": "uuid",
    "i": "int4",
    "n": "int8",
    "f": "float8",
    "ok": "boolean",
    "ts": "timestamptz",
    "d": "date",
    "j": "jsonb",
}
# What Postgres can hold: no NUL (text, jsonb), no lone surrogate (asyncpg encodes UTF-8).
_CHARS = st.characters(exclude_characters="\x00", exclude_categories=("Cs",))
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(_CHARS),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(_CHARS, max_size=5), inner, max_size=3),
    max_leaves=8,
).map(json.dumps)
_OFFSETS = st.sampled_from([timezone.utc, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-11))])
ROWS = st.fixed_dictionaries(
    {
        "t": st.none() | st.text(_CHARS),
        "u": st.none() | st.uuids(),
        "i": st.none() | st.integers(-(2**31), 2**31 - 1),
        "n": st.none() | st.integers(-(2**63), 2**63 - 1),
        "f": st.none() | st.floats(allow_nan=False, allow_infinity=False),
        "ok": st.none() | st.booleans(),
        "ts": st.none() | st.datetimes(timezones=_OFFSETS),
        "d": st.none() | st.dates(),
        "j": st.none() | _JSON,
    }
)


async def _stored_both_ways(conn: asyncpg.Connection, row: dict) -> None:
    cols = ", ".join(COLUMNS)
    # As the allocator's held save goes: an INSERT (and an UPDATE) in a simple query, with a statement after it.
    literals = ", ".join(value_literal(row[c]) for c in COLUMNS)
    await conn.execute(f"INSERT INTO lit (k, {cols}) VALUES ('literal', {literals}); SELECT 1")
    sets = ", ".join(f"{c} = {value_literal(row[c])}" for c in COLUMNS)
    await conn.execute(f"INSERT INTO lit (k) VALUES ('updated'); UPDATE lit SET {sets} WHERE k = 'updated'")
    params = ", ".join(f"${i}" for i in range(1, len(COLUMNS) + 1))
    await conn.execute(f"INSERT INTO lit (k, {cols}) VALUES ('param', {params})", *(row[c] for c in COLUMNS))
    got = {r["k"]: tuple(r)[1:] for r in await conn.fetch(f"SELECT k, {cols} FROM lit")}
    await conn.execute("DELETE FROM lit")
    assert got["literal"] == got["updated"] == got["param"], got


def test_every_value_literal_is_stored_as_its_parameter(postgres_server: PostgresServer) -> None:
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(asyncpg.connect(postgres_server.dsn))
    try:
        columns = ", ".join(f"{c} {t}" for c, t in COLUMNS.items())
        loop.run_until_complete(conn.execute(f"CREATE TEMP TABLE lit (k text, {columns})"))

        @settings(max_examples=300, deadline=None)
        @given(ROWS)
        def check(row: dict) -> None:
            loop.run_until_complete(_stored_both_ways(conn, row))

        check()
    finally:
        loop.run_until_complete(conn.close())
        loop.close()


def test_a_value_without_one_meaning_is_refused() -> None:
    with pytest.raises(ValueError):
        value_literal(datetime(2026, 1, 1))  # naive: which zone?
    with pytest.raises(TypeError):
        value_literal(b"bytes")
    assert value_literal(-5) == "E'-5'"  # quoted: `x -` and a negative number can never make a `--` comment
