"""`sql_literal` renders values for statements sent without parameters (the allocator's writes behind): each
literal must reach Postgres as the same value asyncpg would have sent as a parameter, and anything it cannot
render exactly is refused."""

from __future__ import annotations

import asyncio
import enum
import json
import math
import uuid
from datetime import datetime, timedelta, timezone

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuaas_common.db import NoLiteral, bind_literals, sql_literal
from gpuaas_dev.testing.servers import PostgresServer


class Slots(enum.IntEnum):
    EIGHT = 8


HOSTILE = "it's a \\'trap\\' $$; DROP TABLE x; -- \\x41 \u00e9\u6f22 \U0001f680"

CASES = [
    (None, "text"),
    (True, "boolean"),
    (False, "boolean"),
    (0, "integer"),
    (-(2**40), "bigint"),
    (Slots.EIGHT, "integer"),
    (1.5e-7, "double precision"),
    ("", "text"),
    (HOSTILE, "text"),
    (uuid.UUID("12345678-1234-5678-1234-567812345678"), "uuid"),
    (datetime(2026, 11, 25, 23, 59, 1, 123456, tzinfo=timezone.utc), "timestamptz"),
    (datetime(2026, 11, 25, 1, 2, 3, tzinfo=timezone(timedelta(hours=-7, minutes=-30))), "timestamptz"),
    ({"a": HOSTILE, "n": [1, 2.5, None, True]}, "jsonb"),
    ([{"slot": "n1-0"}, "x"], "jsonb"),
]


@pytest.mark.parametrize(("value", "type_"), CASES, ids=[f"{t}-{i}" for i, (_, t) in enumerate(CASES)])
async def test_a_literal_arrives_as_the_parameter_would(fresh_db, value, type_) -> None:
    conn = await asyncpg.connect(fresh_db)
    try:
        await conn.set_type_codec("jsonb", encoder=lambda v: v, decoder=lambda v: v, schema="pg_catalog")
        from_literal = await conn.fetchval(f"SELECT ({sql_literal(value)})::{type_}::text")
        param = json.dumps(value) if isinstance(value, (dict, list)) else value
        if isinstance(value, enum.IntEnum):
            param = int(value)
        from_param = await conn.fetchval(f"SELECT ($1::{type_})::text", param)
        assert from_literal == from_param
    finally:
        await conn.close()


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, datetime(2026, 1, 1), b"bytes", {1, 2}, timedelta(seconds=1), "nul\x00inside"],
    ids=["nan", "inf", "naive-datetime", "bytes", "set", "timedelta", "nul"],
)
async def test_values_without_an_exact_literal_are_refused(value) -> None:
    with pytest.raises(NoLiteral):
        sql_literal(value)


# `bind_literals`: a statement with its parameters as constants does what the statement with parameters does.
BOUND = [
    ("SELECT $1::text || '/' || $2::integer::text", (HOSTILE, 7)),
    ("SELECT array_to_string($1::text[], ',') || $2::text", (["reserved", HOSTILE, ""], "!")),
    ("SELECT cardinality($1::text[])::text", ([],)),
    ("SELECT coalesce(array_length($1::integer[], 1), -1)::text", (None,)),
    ("SELECT ($1::integer[])::text", ([0, 3, -2],)),
    ("SELECT ($2::uuid)::text || $1::boolean::text", (False, uuid.UUID("12345678-1234-5678-1234-567812345678"))),
    ("SELECT ($1::jsonb ->> 'a')", (json.dumps({"a": HOSTILE}),)),
    # Bare, -1 after the minus would start a comment that swallows the rest of the line.
    ("SELECT (1 -$1::integer)::text || $2::text", (-1, "\n; DROP TABLE x; --")),
    # $1 is not the start of $10.
    (
        "SELECT $10::text || $1::text || ($2::integer + $3::integer + $4::integer + $5::integer + $6::integer "
        "+ $7::integer + $8::integer + $9::integer)::text",
        ("one", 2, 3, 4, 5, 6, 7, 8, 9, "ten"),
    ),
]


@pytest.mark.parametrize(("sql", "args"), BOUND, ids=[str(i) for i in range(len(BOUND))])
async def test_bound_literals_do_what_the_parameters_do(fresh_db, sql, args) -> None:
    conn = await asyncpg.connect(fresh_db)
    try:
        assert await conn.fetchval(bind_literals(sql, *args)) == await conn.fetchval(sql, *args)
    finally:
        await conn.close()


def test_bind_literals_refuses_what_it_cannot_render() -> None:
    with pytest.raises(NoLiteral):
        bind_literals("SELECT $1::text[]", "not a list")
    with pytest.raises(NoLiteral):
        bind_literals("SELECT $2::text", "only one value")
    with pytest.raises(NoLiteral):
        bind_literals("SELECT $1::text[]", ["nul\x00inside"])


# Every type `sql_literal` renders, each drawn with the Postgres type a parameter of it is bound as. Decimals stay
# within what Postgres's numeric holds (beyond it asyncpg encodes some as 0 instead of refusing them).
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_TYPED = st.one_of(
    st.tuples(st.none(), st.just("text")),
    st.tuples(st.booleans(), st.just("boolean")),
    st.tuples(st.integers() | st.sampled_from(Slots), st.just("numeric")),
    st.tuples(st.floats(allow_nan=False, allow_infinity=False), st.just("double precision")),
    st.tuples(
        st.decimals(allow_nan=False, allow_infinity=False).filter(
            lambda d: d.as_tuple().exponent >= -16383 and d.adjusted() < 131000  # type: ignore[operator]
        ),
        st.just("numeric"),
    ),
    st.tuples(st.text(st.characters(exclude_characters="\x00")), st.just("text")),
    st.tuples(st.uuids(), st.just("uuid")),
    st.tuples(
        st.datetimes(
            timezones=st.builds(
                timezone, st.timedeltas(min_value=timedelta(hours=-23, minutes=-59), max_value=timedelta(hours=23))
            )
        ),
        st.just("timestamptz"),
    ),
    st.tuples(st.lists(_JSON, max_size=4) | st.dictionaries(st.text(max_size=8), _JSON, max_size=4), st.just("jsonb")),
)
_NUMERIC = {"numeric", "double precision"}
# What a value neither form can carry meets: Postgres refusing it, or asyncpg before it is sent (a lone surrogate).
_REFUSED = (asyncpg.PostgresError, asyncpg.InterfaceError, UnicodeEncodeError)


async def _outcome(conn: asyncpg.Connection, sql: str, *args: object) -> tuple[str, object]:
    try:
        return "value", await conn.fetchval(sql, *args)
    except _REFUSED:
        return "refused", None


async def _compare(conn: asyncpg.Connection, value: object, type_: str) -> None:
    try:
        literal = sql_literal(value)
    except NoLiteral:
        return  # refusing is always allowed: the caller binds a parameter instead
    param = json.dumps(value) if isinstance(value, (dict, list)) else value
    if isinstance(value, enum.IntEnum):
        param = int(value)
    forms = [
        # Bare before a cast, as `bind_literals` places it (`$2::integer::text`): a cast binds tighter than a sign.
        (f"SELECT {literal}::{type_}::text", f"SELECT $1::{type_}::text"),
        (f"SELECT ({literal})::{type_}::text", f"SELECT ($1::{type_})::text"),
    ]
    if type_ in _NUMERIC:
        # After a minus, as in a template `a -$1`.
        forms.append((f"SELECT (1::{type_} -{literal})::text", f"SELECT (1::{type_} - $1::{type_})::text"))
    for with_literal, with_param in forms:
        expected = await _outcome(conn, with_param, param)
        assert await _outcome(conn, with_literal) == expected, (value, with_literal)


def test_every_literal_reads_back_as_its_parameter(postgres_server: PostgresServer) -> None:
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(asyncpg.connect(postgres_server.dsn))
    try:

        @settings(max_examples=400, deadline=None)
        @given(_TYPED)
        def check(typed: tuple[object, str]) -> None:
            loop.run_until_complete(_compare(conn, *typed))

        check()
    finally:
        loop.run_until_complete(conn.close())
        loop.close()
