"""Read-only means read-only (issue 38, review finding N1), across real HTTP between a real ops console
(ops-view) and a real scheduler admin API, both on real Postgres: each principal has its own token and named
rights, checked by the service that owns the action; the console acts for the signed-in person with that
person's rights, and the scheduler audits the person it authenticated, never a typed actor."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import asyncpg
import pytest
from pydantic import SecretStr

from gpuaas_common.admin_http import PERSON_HEADER, assert_person, login_link
from gpuaas_common.admin_http.login import LOGIN, SESSION, mint
from gpuaas_common.bus import parse_message
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_ops_view.adapters.changes import Changes
from gpuaas_ops_view.adapters.scheduler_admin import SchedulerAdmin
from gpuaas_ops_view.entrypoints.admin_http import ops_api
from gpuaas_ops_view.entrypoints.web.pages import Console
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.entrypoints.admin_http import admin_api

from .scheduler_db import scheduler_pool

# One secret per principal, none shared.
OPS, BILLING, LOGIN_SECRET = "ops-read-token-0123456789", "billing-token-0123456789", "console-login-key-012345"
OPS_ADMIN, CONSOLE = "scheduler-ops-admin-token-0123", "ops-console-token-0123456789"
NODE = "n00001"
AUDIT_SUBJECT = "gpuaas.scheduler.admin.request_recorded"


@dataclass
class Plane:
    ops_url: str
    scheduler_url: str
    scheduler_pool: asyncpg.Pool

    async def scheduler_audit(self) -> list[tuple[str, str, str, int]]:
        """The scheduler's audit rows (principal, actor, path, status), and each row's event checked against the
        contract: the same who on the bus."""
        async with self.scheduler_pool.acquire() as conn:
            rows = await conn.fetch("SELECT principal, actor, path, status FROM admin_requests ORDER BY id")
            bodies = [
                r["body"]
                for r in await conn.fetch("SELECT subject, body FROM outbox ORDER BY id")
                if r["subject"] == AUDIT_SUBJECT
            ]
        events = [parse_message(AUDIT_SUBJECT, b.encode() if isinstance(b, str) else b) for b in bodies]
        on_bus = [(p.principal, p.actor, p.path, p.status) for _, p in events]  # type: ignore[attr-defined]
        stored = [tuple(r) for r in rows]
        assert on_bus == stored
        return stored


@pytest.fixture
async def plane(fresh_db: str) -> AsyncIterator[Plane]:
    async with scheduler_pool(fresh_db) as spool:
        async with spool.acquire() as conn:
            await synthetic.build(conn, slice_hosts=1)
        scheduler = admin_api(spool, SecretStr(OPS_ADMIN), console_token=SecretStr(CONSOLE))
        sport = await scheduler.start("127.0.0.1", 0)
        conn = await asyncpg.connect(fresh_db)
        await apply_migrations(conn, "ops_view", "gpuaas_ops_view.migrations")
        await conn.close()
        pool = await create_pool(fresh_db, "ops_view")
        changes = Changes(pool)
        task = asyncio.create_task(changes.run())
        await asyncio.wait_for(changes.listening.wait(), 10)

        async def no_state() -> dict[str, tuple[int, int] | None]:
            return {}

        link = SchedulerAdmin(f"http://127.0.0.1:{sport}", SecretStr(CONSOLE))
        view = ops_api(
            pool,
            SecretStr(OPS),
            no_state,
            Console(pool, changes, link),
            billing_token=SecretStr(BILLING),
            login_secret=SecretStr(LOGIN_SECRET),
        )
        port = await view.start("127.0.0.1", 0)
        try:
            yield Plane(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{sport}", spool)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await view.stop()
            await link.close()
            await scheduler.stop()
            await pool.close()


def _browser() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def _sign_in(http: aiohttp.ClientSession, link: str) -> None:
    async with http.get(link, allow_redirects=False) as resp:
        assert resp.status == 303, await resp.text()


# Every change the console's pages offer: (form path, form fields).
CHANGES = [
    ("/console/fleet/drain", {"node_id": NODE, "reason": "x", "maintenance": "on"}),
    ("/console/fleet/undrain", {"node_id": NODE, "reason": "x"}),
    (f"/console/allocations/{uuid.uuid4()}/force-release", {"reason": "x", "force": "on"}),
    ("/console/policies/quota", {"tenant": "acme", "max_gpus": "0", "reason": "x"}),
    ("/console/policies/wipe-policy", {"region": "default", "destructive_wipe_policy": "blkdiscard", "reason": "x"}),
    (f"/console/fleet/{NODE}/waiver", {"gate": "parity", "expires_at": "2099-01-01T00:00:00Z", "reason": "x"}),
    (f"/console/fleet/{NODE}/approve", {"reason": "x"}),
    (f"/console/fleet/{NODE}/disable", {"slot_id": f"{NODE}-gpu0", "reason": "x"}),
    (f"/console/fleet/{NODE}/repair", {"slot_id": f"{NODE}-gpu0", "reason": "x"}),
]


async def test_a_read_only_session_is_refused_every_change_and_the_scheduler_sees_nothing(plane: Plane) -> None:
    """The review's reproduction: a session opened with read rights posts every console form; the console refuses
    each (403) before any call, so the scheduler has no request, no audit row, no change."""
    async with _browser() as http:
        await _sign_in(http, login_link(plane.ops_url, LOGIN_SECRET, "ops", "alice"))
        async with http.get(f"{plane.ops_url}/console/fleet") as resp:
            assert resp.status == 200  # it reads
        for path, form in CHANGES:
            async with http.post(f"{plane.ops_url}{path}", data=form, headers={"Origin": plane.ops_url}) as resp:
                body = await resp.text()
                assert resp.status == 403, (path, body)
                assert "alice is signed in with ops rights, which change nothing here" in body, path
    assert await plane.scheduler_audit() == []


async def test_links_and_sessions_keyed_from_the_ops_token_or_expired_open_nothing(plane: Plane) -> None:
    """Before, a link HMAC-keyed from the ops token signed anyone in; now links come from the login secret only."""
    now = time.time()
    refused = {
        "keyed from the ops token": login_link(plane.ops_url, OPS, "ops", "alice"),
        "keyed from the ops token, admin rights": login_link(plane.ops_url, OPS, "ops-admin", "alice"),
        "expired": f"{plane.ops_url}/console/login?token="
        + mint(LOGIN_SECRET, "ops-admin", "alice", purpose=LOGIN, ttl_s=60, now=now - 3600),
        "rights no person signs in with": f"{plane.ops_url}/console/login?token="
        + mint(LOGIN_SECRET, "billing", "alice", purpose=LOGIN, ttl_s=600),
        "the console's own principal": f"{plane.ops_url}/console/login?token="
        + mint(LOGIN_SECRET, "ops-console", "alice", purpose=LOGIN, ttl_s=600),
    }
    async with _browser() as http:
        for what, link in refused.items():
            async with http.get(link, allow_redirects=False) as resp:
                assert resp.status == 401, what
                assert "Set-Cookie" not in resp.headers, what
        assert "expired" in await (await http.get(refused["expired"])).text()
        forged = mint(OPS, "ops-admin", "alice", purpose=SESSION, ttl_s=600)
        async with http.post(
            f"{plane.ops_url}/console/fleet/drain",
            data=CHANGES[0][1],
            cookies={"gpuaas_session": forged},
            headers={"Origin": plane.ops_url},
        ) as resp:
            assert resp.status == 401
    with pytest.raises(ValueError):
        login_link(plane.ops_url, LOGIN_SECRET, "billing", "alice")
    assert await plane.scheduler_audit() == []


async def test_an_admin_session_acts_as_its_person_and_a_cookie_without_origin_changes_nothing(plane: Plane) -> None:
    async with _browser() as http:
        await _sign_in(http, login_link(plane.ops_url, LOGIN_SECRET, "ops-admin", "alice"))
        # A client replaying the cookie sends no Origin: not one of the console's forms.
        async with http.post(f"{plane.ops_url}/console/fleet/drain", data=CHANGES[0][1]) as resp:
            assert resp.status == 403 and "own pages" in await resp.text()
        assert await plane.scheduler_audit() == []
        form = {**CHANGES[0][1], "actor": "mallory"}  # a typed actor in the form goes nowhere either
        async with http.post(
            f"{plane.ops_url}/console/fleet/drain", data=form, headers={"Origin": plane.ops_url}, allow_redirects=False
        ) as resp:
            assert resp.status == 303, await resp.text()
    assert await plane.scheduler_audit() == [("ops-console", "alice", f"/v1/nodes/{NODE}/drain", 200)]
    async with plane.scheduler_pool.acquire() as conn:
        drained_by = await conn.fetchval(
            "SELECT actor FROM admin_audit WHERE target = $1 ORDER BY at DESC LIMIT 1", NODE
        )
    assert drained_by == "alice"


async def _scheduler(
    plane: Plane, token: str, path: str, body: dict, *, person: str | None = None, key: str | None = None, **headers
) -> tuple[int, dict]:
    raw = json.dumps(body).encode()
    key = key or uuid.uuid4().hex
    sent = {"Authorization": f"Bearer {token}", "Idempotency-Key": key, "Content-Type": "application/json", **headers}
    if person is not None:
        sent[PERSON_HEADER] = person
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{plane.scheduler_url}{path}", data=raw, headers=sent) as resp,
    ):
        return resp.status, await resp.json()


async def test_the_scheduler_checks_the_console_and_audits_the_authenticated_person(plane: Plane) -> None:
    """The owner's check, without the console in front: the console's token alone changes nothing, an assertion
    of read rights or of another request changes nothing, and the audit names the asserted person or the token's
    principal even when the client types another name (X-Actor, the body's actor)."""
    drain = f"/v1/nodes/{NODE}/drain"
    body = {"actor": "mallory", "reason": "rack swap"}

    def person(rights: str, key: str, path: str = drain) -> str:
        return assert_person(
            CONSOLE, "alice", rights, method="POST", path=path, body=json.dumps(body).encode(), idempotency_key=key
        )

    status, answer = await _scheduler(plane, CONSOLE, drain, body)
    assert status == 403 and answer["error"]["code"] == "forbidden"
    status, answer = await _scheduler(plane, CONSOLE, drain, body, person=person("ops", "k1"), key="k1")
    assert status == 403 and answer["error"]["code"] == "forbidden"
    # Signed for undrain, replayed on drain; signed under another key; signed with the wrong secret.
    for forged, key in (
        (person("ops-admin", "k2", f"/v1/nodes/{NODE}/undrain"), "k2"),
        (person("ops-admin", "k3"), "k3-other"),
        (
            assert_person(OPS_ADMIN, "alice", "ops-admin", method="POST", path=drain, body=b"", idempotency_key="k4"),
            "k4",
        ),
    ):
        status, answer = await _scheduler(plane, CONSOLE, drain, body, person=forged, key=key)
        assert (status, answer["error"]["code"]) == (403, "forbidden"), answer
    # The assertion is only the console's to make: with the admin token the header changes no one.
    status, _ = await _scheduler(plane, OPS_ADMIN, drain, body, person=person("ops-admin", "k5"), key="k5")
    assert status == 200
    status, _ = await _scheduler(
        plane, CONSOLE, drain, body, person=person("ops-admin", "k6"), key="k6", **{"X-Actor": "mallory"}
    )
    assert status == 200
    status, _ = await _scheduler(plane, OPS_ADMIN, drain, body, key="k7", **{"X-Actor": "mallory"})
    assert status == 200
    for token in (OPS, BILLING, LOGIN_SECRET):  # no other principal's secret is a scheduler token
        assert (await _scheduler(plane, token, drain, body))[0] == 401
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{plane.scheduler_url}/v1/nodes", headers={"Authorization": f"Bearer {CONSOLE}"}) as resp:
            assert resp.status == 200  # the console reads by itself
    # Audited: what an authenticated principal was refused by its rights and what it did, under who it is; an
    # assertion that does not verify is refused before any of it.
    assert [(p, a, s) for p, a, _, s in await plane.scheduler_audit()] == [
        ("ops-console", "ops-console", 403),
        ("ops-console", "alice", 403),
        ("ops-admin", "ops-admin", 200),
        ("ops-console", "alice", 200),
        ("ops-admin", "ops-admin", 200),
    ]


async def test_the_billing_token_exports_usage_and_nothing_else(plane: Plane) -> None:
    async with aiohttp.ClientSession() as http:
        for token, path, status in [
            (BILLING, "/v1/usage?month=2026-11", 200),
            (OPS, "/v1/usage?month=2026-11", 200),
            (BILLING, "/v1/allocations", 403),
            (BILLING, "/v1/hosts", 403),
            (BILLING, "/v1/audit", 403),
            (BILLING, "/v1/streams", 403),
            (BILLING, "/v1/dead-letters", 403),
            (BILLING, "/console/fleet", 403),
            (BILLING, "/console/usage", 403),
            (OPS, "/v1/allocations", 200),
        ]:
            async with http.get(f"{plane.ops_url}{path}", headers={"Authorization": f"Bearer {token}"}) as resp:
                assert resp.status == status, (token[:4], path, await resp.text())
                if status == 403 and path.startswith("/v1/"):
                    error = (await resp.json())["error"]
                    assert error["code"] == "forbidden" and error["details"] == {"needs": "read"}
