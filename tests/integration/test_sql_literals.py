"""`sql_literal` renders values for statements sent without parameters (the allocator's writes behind): each
literal must reach Postgres as the same value asyncpg would have sent as a parameter, and anything it cannot
render exactly is refused."""

from __future__ import annotations

import enum
import json
import math
import uuid
from datetime import datetime, timedelta, timezone

import asyncpg
import pytest

from gpuaas_common.db import NoLiteral, sql_literal


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
