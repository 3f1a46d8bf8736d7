"""The shared admin stack's rules, stated once through the scheduler's API: who is audited, what a
refusal leaves behind, the JSON error shape for what no handler answers, and one key racing itself."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, SecretStr

from gpuaas_common.admin_http.api import AdminApi
from gpuaas_common.admin_http.routes import Call, Route
from gpuaas_common.bus import parse_message
from gpuaas_scheduler.adapters import synthetic

from .scheduler_db import ADMIN_AUTH, ADMIN_TOKEN, admin_client, scheduler_pool

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
        # Who the token authenticates, never the X-Actor the client typed (principals.py).
        ("req-1", "ops-admin", "ops-admin", "POST", "/v1/nodes/n00001/drain", "k-audit", 200, None),
        ("req-2", "ops-admin", "ops-admin", "POST", "/v1/nodes/nope/drain", "k-2", 404, "node_not_found"),
    ]
    assert len(rows[0]["body_sha256"]) == 64
    # Only the accepted request stored an answer: the refused one may be retried under its key.
    assert [tuple(r) for r in stored] == [("k-audit", "ops-admin", "req-1")]


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


async def test_the_api_serves_its_own_document_and_a_page_of_it_without_a_token(api):
    import json
    from html import escape as html_escape

    import yaml

    from gpuaas_scheduler.entrypoints.admin_http import openapi_document

    expected = json.loads(json.dumps(openapi_document()))
    as_json = await api.get("/openapi.json")
    assert as_json.status == 200 and as_json.content_type == "application/json"
    assert await as_json.json() == expected
    as_yaml = await api.get("/openapi.yaml")
    assert as_yaml.status == 200 and yaml.safe_load(await as_yaml.text()) == expected

    page = await api.get("/docs")
    assert page.status == 200 and page.content_type == "text/html"
    html = await page.text()
    for path, ops in expected["paths"].items():
        for method, op in ops.items():
            row = next(
                line for line in html.splitlines() if f"<code>{path}</code>" in line and f">{method.upper()}<" in line
            )
            assert html_escape(op["summary"]) in row, row
            ok = op["responses"][next(s for s in op["responses"] if s.startswith("2"))]
            assert ok["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1] in row
            if "requestBody" in op:
                assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1] in row
    # Served on networks with no way out: nothing on the page is fetched from anywhere else, and no script runs.
    assert (
        "<script" not in html
        and "http://" not in html
        and "https://" not in html
        and "//" not in html.replace("<!doctype html>", "")
    )

    # The description is public; what the service holds is not.
    assert (await api.get("/v1/nodes")).status == 401
    assert (await api.post("/docs")).status == 401


async def test_api_docs_prints_urls_the_running_api_answers(pool, tmp_path):
    import json

    import aiohttp
    from pydantic import SecretStr
    from typer.testing import CliRunner

    from gpuaas_dev.cli import app
    from gpuaas_scheduler.entrypoints.admin_http import admin_api

    server = admin_api(pool, SecretStr("a-token-the-docs-do-not-need"))
    port = await server.start("127.0.0.1", 0)
    try:
        (tmp_path / "stack.json").write_text(json.dumps({"scheduler_admin_url": f"http://127.0.0.1:{port}"}))
        res = await asyncio.to_thread(
            CliRunner().invoke, app, ["api", "docs", "-o", "json", "--run-dir", str(tmp_path)]
        )
        assert res.exit_code == 0, res.output
        rows = {r["api"]: r for r in json.loads(res.stdout)["apis"]}
        scheduler = rows["scheduler"]
        assert scheduler["docs_url"] == f"http://127.0.0.1:{port}/docs"
        assert rows["image-pipeline"]["docs_url"] is None, "no image pipeline in this stack.json"
        async with aiohttp.ClientSession() as http:
            async with http.get(scheduler["docs_url"]) as page:
                assert page.status == 200 and "/v1/nodes/{node_id}/drain" in await page.text()
            async with http.get(scheduler["openapi_url"]) as doc:
                assert doc.status == 200 and (await doc.json())["info"]["title"] == "gpuaas scheduler admin API"
    finally:
        await server.stop()


async def test_each_audited_mutation_goes_to_the_bus_with_its_why(api, pool):
    """Applied, replayed and refused alike: the audit row's event is in the outbox of the row's transaction,
    with the body's reason (the why the admin_requests table keeps only as a digest)."""
    headers = {**ADMIN_AUTH, "Idempotency-Key": "k-bus", "X-Actor": "carol@ops", "X-Request-Id": "req-bus-1"}
    for request_id in ("req-bus-1", "req-bus-2"):  # the second replays the first's answer
        resp = await api.post("/v1/nodes/n00001/drain", json=DRAIN, headers={**headers, "X-Request-Id": request_id})
        assert resp.status == 200
    refused = await api.post(
        "/v1/nodes/nope/drain",
        json={**DRAIN, "reason": "wrong node"},
        headers={**headers, "Idempotency-Key": "k-bus-2", "X-Request-Id": "req-bus-3"},
    )
    assert refused.status == 404
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT subject, body FROM outbox ORDER BY id")
    events = [json.loads(r["body"]) for r in rows if r["subject"] == "gpuaas.scheduler.admin.request_recorded"]
    for event in events:
        parse_message("gpuaas.scheduler.admin.request_recorded", json.dumps(event).encode())
    assert [
        (
            e["producer"],
            e["payload"]["request_id"],
            e["payload"]["actor"],
            e["payload"]["principal"],
            e["payload"]["path"],
            e["payload"]["status"],
            e["payload"]["error_code"],
            e["payload"]["replayed"],
            e["payload"]["reason"],
        )
        for e in events
    ] == [
        ("scheduler", "req-bus-1", "ops-admin", "ops-admin", "/v1/nodes/n00001/drain", 200, None, False, "rack swap"),
        ("scheduler", "req-bus-2", "ops-admin", "ops-admin", "/v1/nodes/n00001/drain", 200, None, True, "rack swap"),
        (
            "scheduler",
            "req-bus-3",
            "ops-admin",
            "ops-admin",
            "/v1/nodes/nope/drain",
            404,
            "node_not_found",
            False,
            "wrong node",
        ),
    ]


class _Modes(BaseModel):
    before: str
    after: str


async def test_a_read_answers_from_one_snapshot(pool):
    """Every query of one read sees the same moment: a change committed between two of them is in neither, so
    one answer never pairs a row from before a commit with one from after it."""
    first_read, committed = asyncio.Event(), asyncio.Event()

    async def probe(call: Call) -> dict:
        before = await call.conn.fetchval("SELECT mode FROM nodes WHERE node_id = 'n00001'")
        first_read.set()
        await committed.wait()
        after = await call.conn.fetchval("SELECT mode FROM nodes WHERE node_id = 'n00001'")
        return {"before": before, "after": after}

    api = AdminApi(
        service="scheduler",
        schema="scheduler",
        pool=pool,
        tokens={"admin": SecretStr(ADMIN_TOKEN)},
        routes=[Route("GET", "/v1/probe", probe, "two reads of one node's mode", _Modes)],
    )
    async with TestClient(TestServer(api.app(), host="127.0.0.1")) as client:
        answer = asyncio.create_task(client.get("/v1/probe", headers=ADMIN_AUTH))
        await first_read.wait()
        async with pool.acquire() as conn:
            await conn.execute("UPDATE nodes SET mode = 'drained' WHERE node_id = 'n00001'")
        committed.set()
        resp = await answer
        assert resp.status == 200
        body = await resp.json()
    assert body["before"] == body["after"] != "drained"
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT mode FROM nodes WHERE node_id = 'n00001'") == "drained"
