"""The ops API's reads over an in-memory `OpsReads` (gpuaas_ops_view.service_layer.ports): what the service layer
makes of the read models' rows (a host's slots, the fleet beside the scheduler's nodes, the streams' catch-up)
without Postgres. The Postgres reads themselves are tests/integration/test_ops_view.py's."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from gpuaas_common.api_error import ApiError
from gpuaas_ops_view.domain.filters import Page
from gpuaas_ops_view.service_layer import queries
from gpuaas_ops_view.service_layer.fleet import fleet

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)
HOST_COLUMNS = ("node_id", "kind", "parity_checked_at", "topology_at", "drift_checked_at", "drift")


class FakeReads:
    """The part of OpsReads a host page, the fleet and the streams read, from lists of rows."""

    def __init__(self) -> None:
        self.hosts: dict[str, dict[str, Any]] = {}
        self.slot_rows: list[dict[str, Any]] = []
        self.claim_rows: list[dict[str, Any]] = []
        self.stream_positions: dict[str, dict[str, Any]] = {}

    async def host(self, node_id: str) -> dict[str, Any] | None:
        row = self.hosts.get(node_id)
        return dict(row) if row else None

    async def unknown_host(self, node_id: str) -> dict[str, Any]:
        return {**dict.fromkeys(HOST_COLUMNS), "node_id": node_id}

    async def claims(
        self, *, allocation_id: uuid.UUID | None = None, node_id: str | None = None
    ) -> list[dict[str, Any]]:
        return [
            dict(c)
            for c in self.claim_rows
            if (allocation_id is None or c["allocation_id"] == allocation_id)
            and (node_id is None or c["node_id"] == node_id)
        ]

    async def slots(self, node_id: str) -> list[dict[str, Any]]:
        return [dict(s) for s in self.slot_rows if s["node_id"] == node_id]

    async def mode_history(self, node_id: str, limit: int = 50) -> list[dict[str, Any]]:
        return []

    async def host_tasks(self, node_id: str, limit: int = 50) -> list[dict[str, Any]]:
        return []

    async def list_hosts(self, node: str | None, kind: str | None, page: Page) -> list[dict[str, Any]]:
        rows = sorted(self.hosts.values(), key=lambda h: h["node_id"])
        rows = [h for h in rows if (node is None or h["node_id"] == node) and (kind is None or h["kind"] == kind)]
        if page.after is not None:
            rows = [h for h in rows if h["node_id"] > page.after[1]]
        return [dict(h) for h in rows[: page.limit + 1]]

    async def positions(self) -> dict[str, dict[str, Any]]:
        return self.stream_positions


def _host(node_id: str, **more: Any) -> dict[str, Any]:
    return {**dict.fromkeys(HOST_COLUMNS), "node_id": node_id, "kind": "slice_host", "drift": [], **more}


def _claim(allocation: uuid.UUID, node_id: str, slot_id: str, *, released: bool = False, forced: bool = False):
    return {
        "allocation_id": allocation,
        "node_id": node_id,
        "slot_id": slot_id,
        "placed_at": T0,
        "released_at": T0 + timedelta(minutes=5) if released else None,
        "outcome": "released" if released else None,
        "forced_by": "ops:alice" if forced else None,
    }


def _slot(node_id: str, slot_id: str, announced: str | None = None) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "slot_id": slot_id,
        "announced_status": announced,
        "announced_at": T0 if announced else None,
    }


async def test_a_host_page_joins_slots_with_their_claims_and_drift() -> None:
    reads = FakeReads()
    held, forced = uuid.uuid4(), uuid.uuid4()
    drift = [{"kind": "vfio_unbound", "slot_ids": ["s1"]}, {"kind": "nvlink_down", "slot_ids": ["s1", "s2"]}]
    reads.hosts["n1"] = _host("n1", drift=drift, parity_checked_at=T0)
    reads.slot_rows = [_slot("n1", "s0"), _slot("n1", "s1"), _slot("n1", "s2", "disabled")]
    reads.claim_rows = [
        _claim(held, "n1", "s0"),
        _claim(forced, "n1", "s1", forced=True),
        _claim(uuid.uuid4(), "n1", "s2", released=True),
    ]

    page = await queries.get_host(reads, "n1")

    by_slot = {s["slot_id"]: s for s in page["slots"]}
    assert by_slot["s0"]["status"] == "held" and by_slot["s0"]["held_by"] == held
    # A forced release still holding its slot: the host must be cleaned up before the slot is anyone's.
    assert by_slot["s1"]["status"] == "cleanup_blocked" and by_slot["s1"]["held_by"] == forced
    assert by_slot["s1"]["drift"] == ["vfio_unbound", "nvlink_down"]
    # The released claim ended after the announcement: the claims speak, and the slot is free.
    assert by_slot["s2"]["status"] == "available" and by_slot["s2"]["held_by"] is None
    assert by_slot["s2"]["drift"] == ["nvlink_down"]
    assert {c["slot_id"] for c in page["claims"]} == {"s0", "s1"}
    assert page["drift_open"] == 2
    assert page["evidence_age_s"]["parity"] is not None and page["evidence_age_s"]["topology"] is None


async def test_a_host_known_only_by_its_claims_has_a_page_and_an_unknown_one_is_404() -> None:
    reads = FakeReads()
    reads.slot_rows = [_slot("n2", "s0")]
    reads.claim_rows = [_claim(uuid.uuid4(), "n2", "s0")]

    page = await queries.get_host(reads, "n2")
    assert page["node_id"] == "n2" and page["kind"] is None
    assert [s["status"] for s in page["slots"]] == ["held"]

    with pytest.raises(ApiError) as refused:
        await queries.get_host(reads, "n3")
    assert (refused.value.status, refused.value.code) == (404, "not_found")
    with pytest.raises(ApiError) as bad:
        await queries.get_host(reads, "n 3")
    assert (bad.value.status, bad.value.details) == (400, {"field": "node_id"})


async def test_the_fleet_shows_each_hosts_admin_view_and_on_its_last_first_page_the_nodes_not_seen_yet() -> None:
    reads = FakeReads()
    for node_id in ("n1", "n2", "n3"):
        reads.hosts[node_id] = _host(node_id)
    admin = {"n1": {"node_id": "n1", "mode": "slice"}, "n9": {"node_id": "n9", "mode": "drained"}}

    whole = await fleet(reads, {}, admin)
    assert [(h["node_id"], h["admin"]) for h in whole["items"]] == [("n1", admin["n1"]), ("n2", None), ("n3", None)]
    assert whole["unseen"] == [admin["n9"]]

    first = await fleet(reads, {"limit": "2"}, admin)
    assert [h["node_id"] for h in first["items"]] == ["n1", "n2"] and first["next_cursor"] is not None
    # More pages follow: a node may be on one of them, so none is called unseen yet.
    assert first["unseen"] == []
    rest = await fleet(reads, {"limit": "2", "cursor": first["next_cursor"]}, admin)
    assert [h["node_id"] for h in rest["items"]] == ["n3"] and rest["unseen"] == []
    assert (await fleet(reads, {}, None))["unseen"] == []


async def test_a_stream_is_caught_up_when_nothing_is_pending_and_all_it_delivered_is_committed() -> None:
    reads = FakeReads()
    reads.stream_positions = {"ALLOC": {"last_seq": 10, "at": T0}, "NODES": {"last_seq": 4, "at": T0}}

    answer = await queries.streams(reads, {"ALLOC": (0, 10), "NODES": (0, 7), "MAAS": (2, 3), "IMAGES": None})

    assert {i["stream"]: (i["position"], i["caught_up"]) for i in answer["items"]} == {
        "ALLOC": (10, True),
        "IMAGES": (0, None),
        "MAAS": (0, False),
        "NODES": (4, False),
    }
