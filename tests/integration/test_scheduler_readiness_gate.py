"""Slot approval gates on the host's own evidence (a passing parity run and commissioning preflight); the only
override is a waiver with who, why and an expiry, kept, audited and listed with the node (issue 26, point 4)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from gpuaas_dev.cli.inventory import _node_detail_text
from gpuaas_scheduler.adapters import inventory as inv

from .scheduler_db import ADMIN_AUTH, accepted, admin_client, candidate, post, report_ready, run_place, scheduler_pool


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        yield p


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


async def _host(api, node_id="h1") -> None:
    body = {
        "actor": "ops",
        "node_id": node_id,
        "kind": "slice_host",
        "hostname": node_id,
        "sku": "h200-sxm-slice",
        "maas_tags": [inv.TAG_SLICE],
    }
    assert (await post(api, "/v1/nodes", body))[0] == 200
    cands = [candidate(0, candidate_id=f"{node_id}-c0")]
    assert (await post(api, f"/v1/nodes/{node_id}/candidates", {"actor": "ops", "candidates": cands}, method="PUT"))[
        0
    ] == 200


async def _counts(pool) -> tuple[int, int, int]:
    async with pool.acquire() as conn:
        return (
            await conn.fetchval("SELECT count(*) FROM node_resource_slots"),
            await conn.fetchval("SELECT count(*) FROM node_waivers"),
            await conn.fetchval(
                "SELECT count(*) FROM admin_audit WHERE action IN ('candidates.approve', 'node.waiver')"
            ),
        )


async def test_approval_needs_a_passing_parity_and_preflight(api, pool):
    await _host(api)
    await report_ready(pool, "h1", parity_failures=2)
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "ops", "reason": "try"})
    assert status == 409 and body["error"]["code"] == "readiness_gate"
    assert list(body["error"]["details"]["gates"]) == ["parity"] and "2 failure(s)" in body["error"]["message"]
    await report_ready(pool, "h1", preflight="failed")
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "ops", "reason": "try"})
    assert status == 409 and list(body["error"]["details"]["gates"]) == ["preflight"]
    assert await _counts(pool) == (0, 0, 0)
    await report_ready(pool, "h1")
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "ops", "reason": "clean"})
    assert status == 200 and body["results"][0]["status"] == "available" and "waived" not in body


async def test_parity_cannot_be_written_by_hand(api, pool):
    await _host(api)
    status, _ = await post(api, "/v1/nodes/h1/readiness", {"actor": "ops", "parity_failures": 0}, method="PUT")
    assert status in (404, 405)
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT parity_failures FROM nodes WHERE node_id = 'h1'") is None


async def test_a_waiver_lets_approval_through_its_gate_only_is_listed_and_audited(api, pool):
    await _host(api)
    await report_ready(pool, "h1", parity_failures=1)
    until = datetime.now(UTC) + timedelta(days=2)
    status, body = await post(
        api,
        "/v1/nodes/h1/waivers",
        {
            "actor": "alice",
            "gate": "parity",
            "reason": "BF3 swap; parity re-run after",
            "expires_at": until.isoformat(),
        },
    )
    assert status == 200, body
    [waiver] = body["waivers"]
    assert (waiver["gate"], waiver["actor"], waiver["active"]) == ("parity", "alice", True)
    assert datetime.fromisoformat(waiver["expires_at"]) == until
    # The evidence is not touched: the host still reports its failure.
    assert body["node"]["parity_failures"] == 1
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "alice", "reason": "waived"})
    assert status == 200 and body["results"][0]["status"] == "available"
    assert [w["waiver_id"] for w in body["waived"]] == [waiver["waiver_id"]]
    async with pool.acquire() as conn:
        audit = await conn.fetch("SELECT actor, action, reason, detail FROM admin_audit ORDER BY id")
    actions = [(a["actor"], a["action"]) for a in audit if a["action"] in ("node.waiver", "candidates.approve")]
    assert actions == [("alice", "node.waiver"), ("alice", "candidates.approve")]
    assert [w["waiver_id"] for w in json.loads(audit[-1]["detail"])["waivers"]] == [waiver["waiver_id"]]
    # `gpuaas nodes show` lists it from the node's admin answer.
    resp = await api.get("/v1/nodes/h1", headers=ADMIN_AUTH)
    text = _node_detail_text(await resp.json(), "table", False)
    assert f"#{waiver['waiver_id']} parity active until {waiver['expires_at']} by alice: BF3 swap" in text
    # Placement gates on the evidence itself: a waived host takes no slice until its parity passes.
    u = (await run_place(pool, accepted())).unschedulable
    assert u is not None and u.filtered.get("parity") == 1, u
    # A parity waiver does not open the preflight gate.
    await report_ready(pool, "h1", parity_failures=1, preflight="failed")
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "alice", "reason": "again"})
    assert status == 409 and list(body["error"]["details"]["gates"]) == ["preflight"]


async def test_an_expired_waiver_no_longer_opens_the_gate(api, pool):
    await _host(api)
    await report_ready(pool, "h1", parity_failures=1)
    until = datetime.now(UTC) + timedelta(days=1)
    assert (
        await post(
            api,
            "/v1/nodes/h1/waivers",
            {"actor": "a", "gate": "parity", "reason": "r", "expires_at": until.isoformat()},
        )
    )[0] == 200
    async with pool.acquire() as conn:
        # The waiver's time passes (the row is as it would be a day later).
        await conn.execute(
            "UPDATE node_waivers SET created_at = now() - interval '2 days', expires_at = now() - interval '1 second'"
        )
    status, body = await post(api, "/v1/nodes/h1/candidates/approve", {"actor": "a", "reason": "late"})
    assert status == 409 and body["error"]["code"] == "readiness_gate"
    resp = await api.get("/v1/nodes/h1", headers=ADMIN_AUTH)
    assert [w["active"] for w in (await resp.json())["waivers"]] == [False]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"reason": None}, "reason"),
        ({"reason": "  "}, "reason"),
        ({"expires_at": None}, "expiry"),
        ({"expires_at": "2020-01-01T00:00:00+00:00"}, "not in the future"),
        ({"expires_at": (datetime.now(UTC) + timedelta(days=90)).isoformat()}, "30 days"),
    ],
    ids=["no_reason", "blank_reason", "no_expiry", "expired", "too_long"],
)
async def test_a_waiver_without_reason_or_expiry_is_refused_and_changes_nothing(api, pool, change, needle):
    await _host(api)
    body = {
        "actor": "ops",
        "gate": "parity",
        "reason": "why",
        "expires_at": (datetime.now(UTC) + timedelta(days=1)).isoformat(),
        **change,
    }
    status, answer = await post(api, "/v1/nodes/h1/waivers", {k: v for k, v in body.items() if v is not None})
    assert status == 422 and answer["error"]["code"] == "waiver_refused", answer
    assert needle in answer["error"]["message"]
    assert await _counts(pool) == (0, 0, 0)


async def test_a_waiver_for_an_unknown_node_is_refused(api, pool):
    until = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    status, answer = await post(
        api, "/v1/nodes/nope/waivers", {"actor": "a", "gate": "parity", "reason": "r", "expires_at": until}
    )
    assert status == 404 and answer["error"]["code"] == "node_not_found"
    assert await _counts(pool) == (0, 0, 0)
