"""The shared admin stack's rules, stated once through the scheduler's API: who is audited, what a
refusal leaves behind, the JSON error shape for what no handler answers, and one key racing itself."""

from __future__ import annotations

import asyncio

import pytest

from gpuaas_scheduler.adapters import synthetic

from .scheduler_db import ADMIN_AUTH, admin_client, scheduler_pool

DRAIN = {"actor": "ops", "reason": "rack swap"}


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        async with p.acquire() as conn:
            await synthetic.build(conn, slice_hosts=1)
        yield p


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


async def test_a_mutation_is_audited_with_who_and_what(api, pool):
    headers = {**ADMIN_AUTH, "Idempotency-Key": "k-audit", "X-Actor": "alice@example", "X-Request-Id": "req-1"}
    resp = await api.post("/v1/nodes/n00001/drain", json=DRAIN, headers=headers)
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "req-1"
    refused = await api.post(
        "/v1/nodes/nope/drain", json=DRAIN, headers={**headers, "Idempotency-Key": "k-2", "X-Request-Id": "req-2"}
    )
    assert refused.status == 404 and (await refused.json())["error"]["request_id"] == "req-2"
    async with pool.acquire() as conn:
        rows = [
            dict(r)
            for r in await conn.fetch(
                "SELECT request_id, principal, actor, method, path, idempotency_key, status, error_code, body_sha256 "
                "FROM admin_requests ORDER BY id"
            )
        ]
        stored = await conn.fetch("SELECT key, actor, request_id FROM admin_idempotency")
    assert [
        (
            r["request_id"],
            r["principal"],
            r["actor"],
            r["method"],
            r["path"],
            r["idempotency_key"],
            r["status"],
            r["error_code"],
        )
        for r in rows
    ] == [
        ("req-1", "admin", "alice@example", "POST", "/v1/nodes/n00001/drain", "k-audit", 200, None),
        ("req-2", "admin", "alice@example", "POST", "/v1/nodes/nope/drain", "k-2", 404, "node_not_found"),
    ]
    assert len(rows[0]["body_sha256"]) == 64
    # Only the accepted request stored an answer: the refused one may be retried under its key.
    assert [tuple(r) for r in stored] == [("k-audit", "alice@example", "req-1")]


async def test_what_no_handler_answers_is_still_the_error_shape(api):
    for method, path, status, code in [
        ("GET", "/v1/nowhere", 404, "not_found"),
        ("DELETE", "/v1/nodes", 405, "method_not_allowed"),
    ]:
        resp = await api.request(method, path, headers={**ADMIN_AUTH, "Idempotency-Key": "x"})
        body = await resp.json()
        assert (resp.status, body["error"]["code"]) == (status, code)
        assert body["error"]["request_id"] == resp.headers["X-Request-Id"]
    resp = await api.post(
        "/v1/nodes/n00001/drain", json=DRAIN, headers={**ADMIN_AUTH, "Idempotency-Key": "k", "X-Actor": "not an id"}
    )
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_actor"
    resp = await api.post(
        "/v1/nodes/n00001/drain",
        data=b'{"actor": "ops", "reason": NaN}',
        headers={**ADMIN_AUTH, "Idempotency-Key": "k"},
    )
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"


async def test_one_key_sent_twice_at_once_acts_once(api, pool):
    headers = {**ADMIN_AUTH, "Idempotency-Key": "k-race"}
    first, second = await asyncio.gather(
        *[api.post("/v1/nodes/n00001/drain", json=DRAIN, headers=headers) for _ in range(2)]
    )
    assert first.status == second.status == 200
    assert await first.json() == await second.json()
    assert sorted(r.headers.get("Idempotent-Replayed", "") for r in (first, second)) == ["", "true"]
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM admin_audit WHERE action = 'node.drain'") == 1
        assert await conn.fetchval("SELECT count(*) FROM admin_requests WHERE replayed") == 1
