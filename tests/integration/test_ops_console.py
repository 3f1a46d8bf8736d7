"""The ops console's server side (services/ops-view, entrypoints/web) against a real nats-server and Postgres:
nobody without a login link minted from the console's login secret sees more than the refusal, a link opens a
session for the pages only, a filter that does not parse is a 400 page naming the field, and a commit of the read models
reaches an open page's event stream. The browser itself is tests/e2e/test_ops_console_browser.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import aiohttp
import asyncpg
import nats
import nats.errors
import pytest
from pydantic import SecretStr

from gpuaas_common.admin_http import login_link
from gpuaas_common.admin_http.login import LOGIN, SESSION, mint
from gpuaas_common.bus import Bus
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.jetstream import FOLLOWERS
from gpuaas_common.migrations import apply_migrations
from gpuaas_dev.testing.waiting import eventually
from gpuaas_ops_view.adapters.changes import Changes
from gpuaas_ops_view.adapters.scheduler_admin import SchedulerAdmin
from gpuaas_ops_view.entrypoints.admin_http import ops_api
from gpuaas_ops_view.entrypoints.follow import StreamFollower
from gpuaas_ops_view.entrypoints.web.pages import Console

from ..bounded import bounded
from .test_ops_view import (  # noqa: F401  (nc: the fixture)
    SCHEMA,
    TOKEN,
    admin_request,
    fleet,
    lifecycle,
    nc,
    publish,
    slots_changed,
    wipe_report,
)

# The console's login-link key: its own, not the ops token (that one only reads the API).
LOGIN_SECRET = "console-login-secret-0123456789"
PAGES = ("fleet", "policies", "allocations", "images", "maas", "dead-letters", "usage", "audit")


class Console_:
    def __init__(self, url: str, pool: asyncpg.Pool, changes: Changes) -> None:
        self.url, self.pool, self.changes = url, pool, changes

    def link(self, actor: str = "alice", token: str = LOGIN_SECRET, rights: str = "ops") -> str:
        return login_link(self.url, token, rights, actor)


@pytest.fixture
async def console(nc: nats.NATS, fresh_db: str) -> AsyncIterator[Console_]:  # noqa: F811
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, SCHEMA, "gpuaas_ops_view.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, SCHEMA)
    js = nc.jetstream()
    letters = Bus(nc, js, service="ops-view", schema=None, pool=None)
    prefix = f"oc-{uuid.uuid4().hex[:8]}"
    followers = [
        StreamFollower(
            nc, js, pool, spec, name=spec.durable.replace("ops-view", prefix, 1), dead_letters=letters, batch=64
        )
        for spec in FOLLOWERS
    ]
    changes = Changes(pool)
    tasks = [asyncio.create_task(f.run()) for f in followers] + [asyncio.create_task(changes.run())]

    async def no_state() -> dict[str, tuple[int, int] | None]:
        return {}

    # The scheduler's admin API is not configured: this console reads; the drain is the browser test's.
    api = ops_api(
        pool,
        SecretStr(TOKEN),
        no_state,
        Console(pool, changes, SchedulerAdmin(None, None)),
        login_secret=SecretStr(LOGIN_SECRET),
    )
    port = await api.start("127.0.0.1", 0)
    await asyncio.wait_for(changes.listening.wait(), 10)
    yield Console_(f"http://127.0.0.1:{port}", pool, changes)
    for task in tasks:
        task.cancel()
    await bounded("the followers and the listener stop", asyncio.gather(*tasks, return_exceptions=True))
    await bounded("the console stops", api.stop())
    await bounded("the pool closes", pool.close())


def _browser(origin: str | None = None) -> aiohttp.ClientSession:
    # unsafe: the console is on 127.0.0.1, and aiohttp keeps no cookie of an IP address without it. `origin`: what
    # a browser names on a form's POST (the console refuses a cookie's change that names none).
    headers = {"Origin": origin} if origin else None
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True), headers=headers)


async def _signed_in(console: Console_, http: aiohttp.ClientSession, actor: str = "alice", rights: str = "ops") -> None:
    async with http.get(console.link(actor, rights=rights), allow_redirects=False) as resp:
        assert resp.status == 303, await resp.text()
        assert resp.headers["Location"] == "/console/"
        cookie = resp.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/console" in cookie, cookie


async def _wait_until_in_model(
    console: Console_, alloc: uuid.UUID, state: str, node: str | None = None, announced: int | None = None
) -> None:
    """Until the follower committed the allocation in `state` (and, given `node`, the host's drift report, the last
    of `fleet`'s events, which another stream's follower applies; given `announced`, the host's slots announcement of
    that number, a third stream's): woken by the models' own change notices."""
    with console.changes.subscribe() as notices:
        while True:
            async with console.pool.acquire() as conn:
                there = await conn.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc) == state
                described = node is None or await conn.fetchval(
                    "SELECT drift_checked_at IS NOT NULL AND kind IS NOT NULL AND slots_generation IS NOT DISTINCT "
                    "FROM $2::bigint FROM hosts WHERE node_id = $1",
                    node,
                    announced,
                )
                if there and described:
                    return
            await asyncio.wait_for(notices.get(), 20)


async def test_without_the_ops_identity_a_visitor_sees_only_the_refusal(nc: nats.NATS, console: Console_) -> None:  # noqa: F811
    tenant, node = f"secret-tenant-{uuid.uuid4().hex[:6]}", f"secret-node-{uuid.uuid4().hex[:6]}"
    alloc = uuid.uuid4()
    await lifecycle(nc, alloc, tenant, node)
    await _wait_until_in_model(console, alloc, "active")

    now = time.time()
    other_identity = "another-token-that-is-not-the-ops-one-0123"
    refused_links = {
        "no token": f"{console.url}/console/login",
        "garbage": f"{console.url}/console/login?token=abc.def",
        "signed by another token": console.link(token=other_identity),
        "expired": f"{console.url}/console/login?token="
        + mint(LOGIN_SECRET, "ops", "alice", purpose=LOGIN, ttl_s=60, now=now - 3600),
        "a session token as a login link": f"{console.url}/console/login?token="
        + mint(LOGIN_SECRET, "ops", "alice", purpose=SESSION, ttl_s=600),
        "signed for another principal": f"{console.url}/console/login?token="
        + mint(LOGIN_SECRET, "scheduler", "alice", purpose=LOGIN, ttl_s=600),
    }
    async with _browser() as http:
        for what, link in refused_links.items():
            async with http.get(link, allow_redirects=False) as resp:
                body = await resp.text()
                assert resp.status == 401, (what, body)
                assert "Sign-in refused" in body and "Set-Cookie" not in resp.headers, what
            assert len(http.cookie_jar) == 0, what
        assert "expired" in await (await http.get(refused_links["expired"])).text()
        # A forged session cookie (a login token, or one signed by another token) opens nothing either.
        for cookie in (
            mint(LOGIN_SECRET, "ops", "alice", purpose=LOGIN, ttl_s=600),
            mint(other_identity, "ops", "alice", purpose=SESSION, ttl_s=600),
            mint(LOGIN_SECRET, "ops", "alice", purpose=SESSION, ttl_s=60, now=now - 3600),
        ):
            async with http.get(f"{console.url}/console/allocations", cookies={"gpuaas_session": cookie}) as resp:
                assert resp.status == 401
        for path in [f"/console/{p}" for p in PAGES] + [f"/console/allocations/{alloc}", "/console/events"]:
            for headers in ({}, {"Authorization": f"Bearer {other_identity}"}):
                async with http.get(f"{console.url}{path}", headers=headers) as resp:
                    body = await resp.text()
                    assert resp.status == 401, (path, body)
                    assert resp.headers["Content-Type"].startswith("text/html")
                    # Nothing of the models: no tenant, no node, no allocation, no page skeleton.
                    assert tenant not in body and node not in body and str(alloc) not in body, path
                    assert 'id="live"' not in body and "<table" not in body and "<script" not in body, path
        async with http.post(f"{console.url}/console/fleet/drain", data={"node_id": node, "reason": "x"}) as resp:
            assert resp.status == 401


async def _use(link: str) -> tuple[int, str, bool]:
    """One browser following the link: the status, the page, and whether it got a session."""
    async with _browser() as http, http.get(link, allow_redirects=False) as resp:
        return resp.status, await resp.text(), "Set-Cookie" in resp.headers


async def test_a_login_link_signs_in_once_across_replicas(console: Console_) -> None:
    """A link opens one session; the second use, on this replica or another on the same database, is the refusal,
    as an expired link is. Of several browsers given one fresh link at once, one gets in."""

    async def no_state() -> dict[str, tuple[int, int] | None]:
        return {}

    other = ops_api(
        console.pool,
        SecretStr(TOKEN),
        no_state,
        Console(console.pool, console.changes, SchedulerAdmin(None, None)),
        login_secret=SecretStr(LOGIN_SECRET),
    )
    replica = f"http://127.0.0.1:{await other.start('127.0.0.1', 0)}"
    try:
        link = console.link("carol")
        status, _, session = await _use(link)
        assert (status, session) == (303, True)
        for again in (link, link.replace(console.url, replica)):
            status, body, session = await _use(again)
            assert (status, session) == (401, False), body
            assert "Sign-in refused" in body and "the link was used already: ask for a new one" in body
        expired = f"{console.url}/console/login?token=" + mint(
            LOGIN_SECRET, "ops", "carol", purpose=LOGIN, ttl_s=60, now=time.time() - 3600
        )
        status, body, session = await _use(expired)
        assert (status, session) == (401, False) and "the link has expired" in body

        fresh = console.link("dave")
        uses = await asyncio.gather(*(_use(fresh.replace(console.url, url)) for url in (console.url, replica) * 3))
        assert sorted(status for status, _, _ in uses) == [303] + [401] * 5
        # A HEAD (a link preview) spends nothing: the link still signs in.
        preview = console.link("erin")
        async with _browser() as http, http.head(preview, allow_redirects=False) as resp:
            assert resp.status == 405
        assert (await _use(preview))[0] == 303

        # The record of a link used is kept until well past its expiry, then pruned at a later sign-in.
        async with console.pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO login_links_used (nonce, expires_at) VALUES "
                "('a0' || repeat('0', 30), now() - interval '2 hours'), "
                "('b0' || repeat('0', 30), now() - interval '10 minutes')"
            )
            used = await conn.fetchval("SELECT count(*) FROM login_links_used")
        assert (await _use(console.link("frank")))[0] == 303
        async with console.pool.acquire() as conn:
            left = {r["nonce"] for r in await conn.fetch("SELECT nonce FROM login_links_used")}
            # Whole nonces: a link's own random nonce may begin with either prefix.
            assert "a0" + "0" * 30 not in left and "b0" + "0" * 30 in left
            assert await conn.fetchval("SELECT count(*) FROM login_links_used") == used  # one pruned, one added
    finally:
        await other.stop()


async def test_a_login_link_opens_the_pages_and_only_them(nc: nats.NATS, console: Console_) -> None:  # noqa: F811
    tenant, node = f"t-{uuid.uuid4().hex[:6]}", f"n-{uuid.uuid4().hex[:6]}"
    alloc = uuid.uuid4()
    await fleet(nc, node)
    await lifecycle(nc, alloc, tenant, node)
    healthy = ("available", "healthy", None)
    blocked = ("cleanup_blocked", "failed", "no blkdiscard proof of the disk")
    await publish(nc, "scheduler.slots_changed", slots_changed(node, 1, s1=healthy, s2=healthy, s5=blocked))
    await _wait_until_in_model(console, alloc, "active", node, announced=1)
    async with _browser() as http:
        await _signed_in(console, http, actor="bob@ops")
        async with http.get(f"{console.url}/console/") as resp:
            body = await resp.text()
            assert resp.status == 200 and str(resp.url).endswith("/console/fleet"), body
            assert "bob@ops" in body
        for name in PAGES:
            async with http.get(f"{console.url}/console/{name}") as resp:
                assert resp.status == 200, (name, await resp.text())
        async with http.get(f"{console.url}/console/allocations", params={"tenant": tenant}) as resp:
            body = await resp.text()
            assert f'data-allocation="{alloc}" data-state="active"' in body, body
        async with http.get(f"{console.url}/console/allocations/{alloc}") as resp:
            body = await resp.text()
            assert resp.status == 200 and 'id="timeline"' in body and node in body, body
        # A host: its slots with their holder and drift, as the streams described them.
        async with http.get(f"{console.url}/console/fleet/{node}") as resp:
            body = await resp.text()
            assert resp.status == 200, body
            assert f'data-slot="{node}-s1" data-status="held"' in body and str(alloc) in body, body
            assert "device_binding" in body  # the drift reported on slot 2
            # A slot never placed, with its health and why, as the scheduler announced it.
            assert f'data-slot="{node}-s5" data-status="cleanup_blocked" data-health="failed"' in body, body
            assert "no blkdiscard proof of the disk" in body

        # The host's slot wipe (its own task, no allocation's) is on its page with each slot's proof.
        wipe = m.SliceSlotWipe(
            task_id=f"wipe-{node}",
            node_id=node,
            deadline=datetime.now(timezone.utc) + timedelta(minutes=10),
            slots=[
                m.WipeSlot(slot_id=f"{node}-s5", nvme_by_id=f"/dev/disk/by-id/nvme-{node}-5", wipe_policy="blkdiscard")
            ],
        )
        await publish(nc, "slice.slot_wipe", wipe, node_id=node)
        await publish(nc, "node.slot_wipe_reported", wipe_report(wipe), node_id=node)

        async def wipe_on_page() -> str | None:
            async with http.get(f"{console.url}/console/fleet/{node}") as resp:
                body = await resp.text()
            return body if f'data-task="{wipe.task_id}" data-status="succeeded"' in body else None

        body = await eventually(wipe_on_page, 20, what="the host's wipe on its page")
        assert f"wipe_reported: {node}-s5 /dev/disk/by-id/nvme-{node}-5: blkdiscard, verified" in body, body
        async with http.get(f"{console.url}/console/fleet/-bad") as resp:
            assert resp.status == 400 and "node_id must be an identifier" in await resp.text()
        # The fleet without the scheduler's admin API: the evidence from the streams, no drain.
        async with http.get(f"{console.url}/console/fleet") as resp:
            body = await resp.text()
            assert 'id="admin-error"' in body and "<fieldset disabled>" in body
        # The session is the pages' only: the JSON API still wants the bearer token.
        async with http.get(f"{console.url}/v1/allocations") as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "unauthorized"
        # A change asked from another site's page is refused, signed in or not.
        async with http.post(
            f"{console.url}/console/fleet/drain",
            data={"node_id": node, "reason": "x"},
            headers={"Origin": "http://elsewhere.example"},
        ) as resp:
            assert resp.status == 403
        async with http.post(
            f"{console.url}/console/logout", allow_redirects=False, headers={"Origin": console.url}
        ) as resp:
            assert resp.status == 303
        async with http.get(f"{console.url}/console/fleet") as resp:
            assert resp.status == 401


async def test_a_form_the_console_cannot_send_is_refused_on_its_page(nc: nats.NATS, console: Console_) -> None:  # noqa: F811
    """What the console checks itself (ids that go into the API's paths, a reason for the audit) is a 400 on the
    form's page naming the field; the scheduler's own refusals are the browser test's.
    Without the scheduler's admin API a well-formed change is a 502 saying so."""
    node = f"n-{uuid.uuid4().hex[:6]}"
    await fleet(nc, node)
    with console.changes.subscribe() as notices:
        while True:
            async with console.pool.acquire() as conn:
                if await conn.fetchval("SELECT 1 FROM hosts WHERE node_id = $1", node):
                    break
            await asyncio.wait_for(notices.get(), 20)
    async with _browser(console.url) as http:
        await _signed_in(console, http, rights="ops-admin")
        for path, form, said in (
            (f"fleet/{node}/disable", {"slot_id": "../x", "reason": "r"}, "slot_id must be an id"),
            (f"fleet/{node}/repair", {"slot_id": f"{node}-s1", "reason": ""}, "reason is required"),
            (f"fleet/{node}/approve", {"reason": ""}, "reason is required"),
            ("policies/quota", {"tenant": "a/b", "max_gpus": "1", "reason": "r"}, "tenant must be an id"),
        ):
            async with http.post(f"{console.url}/console/{path}", data=form) as resp:
                body = await resp.text()
                assert resp.status == 400 and 'id="action-error"' in body and said in body, (path, body)
                assert 'data-page="/console/' in body  # the page the script shows and refreshes, not the action
        async with http.post(
            f"{console.url}/console/fleet/{node}/waiver", data={"gate": "parity", "expires_at": "tomorrow"}
        ) as resp:
            body = await resp.text()
            assert resp.status == 502 and "not configured" in body, body


async def test_a_filter_that_does_not_parse_is_a_400_page_naming_the_field(console: Console_) -> None:
    async with _browser() as http:
        await _signed_in(console, http)
        for path, query, field in (
            ("allocations", {"state": "bogus"}, "state"),
            ("allocations", {"since": "yesterday"}, "since"),
            ("allocations", {"tenant": "no spaces"}, "tenant"),
            ("allocations", {"limit": "0"}, "limit"),
            ("fleet", {"kind": "toaster"}, "kind"),
            ("maas", {"status": "lost"}, "status"),
            ("dead-letters", {"until": "later"}, "until"),
            ("usage", {"month": "2026-13"}, "month"),
        ):
            async with http.get(f"{console.url}/console/{path}", params=query) as resp:
                body = await resp.text()
                assert resp.status == 400, (path, query, body)
                assert 'id="error"' in body and f"{field} " in body.split('id="error"', 1)[1], (path, body)
        async with http.get(f"{console.url}/console/allocations/not-a-uuid") as resp:
            assert resp.status == 400 and "allocation_id must be a UUID" in await resp.text()
        async with http.get(f"{console.url}/console/allocations/{uuid.uuid4()}") as resp:
            assert resp.status == 404


async def test_a_commit_of_the_models_reaches_an_open_page(nc: nats.NATS, console: Console_) -> None:  # noqa: F811
    tenant, node = f"t-{uuid.uuid4().hex[:6]}", f"n-{uuid.uuid4().hex[:6]}"
    alloc = uuid.uuid4()
    async with _browser() as http:
        await _signed_in(console, http)
        async with http.get(f"{console.url}/console/events") as events:
            assert events.status == 200 and events.headers["Content-Type"] == "text/event-stream"
            assert (await events.content.readline()).startswith(b"retry:")
            await lifecycle(nc, alloc, tenant, node, upto="placed")

            async def a_change() -> bytes:
                while True:
                    line = await events.content.readline()
                    if line.startswith(b"event: changed"):
                        return await events.content.readline()

            data = await asyncio.wait_for(a_change(), 20)
            assert data.startswith(b"data: ")
            # What the page's script then fetches: its live part alone, with the allocation in it.
            await _wait_until_in_model(console, alloc, "placed")
            async with http.get(
                f"{console.url}/console/allocations", params={"tenant": tenant}, headers={"X-Console-Live": "1"}
            ) as resp:
                part = await resp.text()
                assert resp.status == 200 and "<html" not in part and "<form" not in part
                assert f'data-allocation="{alloc}" data-state="placed"' in part, part


async def test_the_admin_apis_audit_records_are_listed_by_the_api_and_the_console(
    nc: nats.NATS,  # noqa: F811
    console: Console_,
) -> None:
    node = f"n-{uuid.uuid4().hex[:6]}"
    mine = admin_request(node, "PSU swap", actor="dora@ops")
    refused = admin_request("nope", "typo", actor="dora@ops", status=404)
    other = admin_request(node, "back in service", actor="erin")
    for record in (mine, refused, other):
        await publish(nc, "scheduler.admin_request_recorded", record)
    async with console.pool.acquire() as conn:
        with console.changes.subscribe() as notices:
            while await conn.fetchval("SELECT count(*) FROM audit_records WHERE path LIKE $1", f"%{node}%") < 2:
                await asyncio.wait_for(notices.get(), 20)

    bearer = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=bearer) as http:
        async with http.get(f"{console.url}/v1/audit", params={"actor": "dora@ops"}) as resp:
            page = await resp.json()
            assert resp.status == 200, page
        rows = {r["request_id"]: r for r in page["items"]}
        assert set(rows) >= {mine.request_id, refused.request_id} and other.request_id not in rows
        drain = rows[mine.request_id]
        assert (drain["actor"], drain["path"], drain["status"], drain["reason"], drain["service"]) == (
            "dora@ops",
            f"/v1/nodes/{node}/drain",
            200,
            "PSU swap",
            "scheduler",
        )
        assert rows[refused.request_id]["error_code"] == "node_not_found" and drain["at"]
        async with http.get(f"{console.url}/v1/audit", params={"request_id": other.request_id}) as resp:
            assert [r["actor"] for r in (await resp.json())["items"]] == ["erin"]
        for query, field in (({"actor": "no spaces"}, "actor"), ({"service": "toaster"}, "service")):
            async with http.get(f"{console.url}/v1/audit", params=query) as resp:
                body = await resp.json()
                assert resp.status == 400 and body["error"]["details"]["field"] == field, body
    async with _browser() as http:
        await _signed_in(console, http)
        async with http.get(f"{console.url}/console/audit", params={"actor": "dora@ops"}) as resp:
            body = await resp.text()
            assert resp.status == 200
            assert f'data-request="{mine.request_id}" data-status="200"' in body and "PSU swap" in body, body
            assert other.request_id not in body
        async with http.get(f"{console.url}/console/audit", params={"actor": "no spaces"}) as resp:
            assert resp.status == 400 and "actor must be an actor name" in await resp.text()


async def test_a_machine_releases_erase_is_kept_and_shown_with_its_operation(
    nc: nats.NATS,  # noqa: F811
    console: Console_,
) -> None:
    """maas.release_requested names the erase asked, maas.release_result the erase applied and what MAAS showed of
    it: the operation keeps both (the API and the console's MAAS page show them), one MAAS left unconfirmed marked
    for ops; a deploy has none."""
    node = f"n-{uuid.uuid4().hex[:6]}"
    alloc = uuid.uuid4()
    erased, unconfirmed, deploy = (f"op-{uuid.uuid4().hex[:8]}" for _ in range(3))
    common = {"allocation_id": alloc, "system_id": "abc123", "node_id": node}
    for op in (erased, unconfirmed):
        requested = m.MaasReleaseRequested(operation_id=op, site="s1", erase_mode="secure", **common)
        await publish(nc, "maas.release_requested", requested)
    await publish(
        nc, "maas.deploy_requested", m.MaasDeployRequested(operation_id=deploy, site="s1", profile="bm", **common)
    )
    results = (
        (erased, "released", "erased", None),
        (unconfirmed, "failed", "unconfirmed", "disk_erase_unconfirmed"),
    )
    for op, status, outcome, code in results:
        result = m.MaasReleaseResult(
            operation_id=op,
            resolution="polled",
            attempts=3,
            status=status,  # type: ignore[arg-type]
            erase_mode="secure",
            erase_outcome=outcome,  # type: ignore[arg-type]
            reason_code=code,
            **common,
        )
        await publish(nc, "maas.release_result", result)
    async with console.pool.acquire() as conn:
        with console.changes.subscribe() as notices:
            while await conn.fetchval(
                "SELECT count(*) FROM maas_operations WHERE node_id = $1 AND resolved_at IS NOT NULL", node
            ) < 2 or not await conn.fetchval("SELECT 1 FROM maas_operations WHERE operation_id = $1", deploy):
                await asyncio.wait_for(notices.get(), 20)

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        async with http.get(f"{console.url}/v1/maas/operations", params={"node": node}) as resp:
            page = await resp.json()
            assert resp.status == 200, page
    ops = {o["operation_id"]: (o["op"], o["status"], o["erase_mode"], o["erase_outcome"]) for o in page["items"]}
    assert ops == {
        erased: ("release", "released", "secure", "erased"),
        unconfirmed: ("release", "failed", "secure", "unconfirmed"),
        deploy: ("deploy", "requested", None, None),
    }
    async with _browser() as http:
        await _signed_in(console, http)
        async with http.get(f"{console.url}/console/maas", params={"node": node}) as resp:
            body = await resp.text()
            assert resp.status == 200, body
    assert f'data-operation="{erased}" data-status="released" data-erase="secure:erased"' in body, body
    assert f'data-operation="{unconfirmed}" data-status="failed" data-erase="secure:unconfirmed"' in body, body
    assert 'secure · <span class="warn">unconfirmed</span>' in body and "secure · erased" in body, body
    assert f'data-operation="{deploy}" data-status="requested">' in body, body
