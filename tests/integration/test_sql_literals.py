"""`text_literal` and `bytea_literal` render the few values sent inside a simple query (the unit of work's BEGIN
with its inbox claim and advisory lock, its COMMIT with the outbox rows): each must reach Postgres as the same
value asyncpg sends as a parameter, and nothing in a value may end its constant."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuaas_common.db import bytea_literal, text_literal
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
