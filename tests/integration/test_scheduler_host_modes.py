"""Host modes over real Postgres, through the admin HTTP API and the scheduler's own placement, release
and evidence paths: a host with approved slots is never handed out whole; slice → baremetal needs the
drain, no live claims and retired slots; a host back from baremetal is `converting` and takes no slice
until it is rediscovered, passes parity and is re-approved; the migration derives existing hosts' modes."""

from __future__ import annotations

import uuid
from datetime import timedelta

import asyncpg
import pytest

from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.migrations import apply_migrations
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.service_layer import evidence
from gpuaas_scheduler.service_layer.handlers import release_allocation
from gpuaas_scheduler.service_layer.placement import PlacementPolicy, place

from .scheduler_db import ADMIN_AUTH, admin_client, scheduler_pool

AUTH = ADMIN_AUTH
# One SKU for both shapes, so one host can serve either and only its mode decides.
SKU = "h200-sxm"
HOST = "n00001"


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        yield p


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


@pytest.fixture
async def convertible(pool):
    """A slice host carrying both profile tags, parity-clean, eight approved slots: the violating fixture
    of today's code, which took it for baremetal."""
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1, convertible=True, sku=SKU)
    return HOST


def accepted(gpus=1, shape="gpu_slice"):
    return m.AllocationAccepted(
        allocation_id=uuid.uuid4(),
        tenant_id="t1",
        shape=shape,
        state="accepted",
        seq=2,
        sku=SKU,
        gpu_count=8 if shape == "baremetal" else gpus,
        region="default",
        image=m.ImageRef(slug="img", digest_sha256="0" * 64, image_path="/img"),
    )


async def run_place(pool, ev):
    async with pool.acquire() as conn, conn.transaction():
        return await place(conn, ev, PlacementPolicy())


async def post(api, path, body, method="POST"):
    resp = await api.request(method, path, json=body, headers={**AUTH, "Idempotency-Key": uuid.uuid4().hex})
    return resp.status, await resp.json()


async def set_mode(api, mode, reason="test", node=HOST):
    return await post(api, f"/v1/nodes/{node}/mode", {"actor": "ops", "mode": mode, "reason": reason})


async def node_row(pool, node=HOST):
    async with pool.acquire() as conn:
        return await conn.fetchrow("SELECT * FROM nodes WHERE node_id = $1", node)


async def history(pool, node=HOST):
    async with pool.acquire() as conn:
        return await conn.fetch("SELECT * FROM node_mode_history WHERE node_id = $1 ORDER BY id", node)


async def assert_no_slice_lands(pool):
    out = await run_place(pool, accepted(1))
    assert out.placed is None and out.unschedulable.filtered == {"host_mode": 1}, out.unschedulable


async def release(pool, allocation_id, cleanup=None):
    async with pool.acquire() as conn, conn.transaction():
        await release_allocation(conn, allocation_id, cleanup or m.CleanupReport(required=False, verified=False))


async def to_baremetal(api):
    for path, body in (
        ("mode", {"mode": "drained", "reason": "tenant needs a whole host"}),
        ("slots/retire", {"reason": "host goes baremetal"}),
        ("mode", {"mode": "baremetal", "reason": "tenant needs a whole host"}),
    ):
        status, answer = await post(api, f"/v1/nodes/{HOST}/{path}", {"actor": "ops", **body})
        assert status == 200, answer


# --- a host with approved slots is never handed out whole ------------------------------------------


async def test_a_slice_host_with_approved_slots_and_both_tags_is_not_taken_for_baremetal(pool, convertible):
    u = (await run_place(pool, accepted(shape="baremetal"))).unschedulable
    assert u.reason_code == "no_eligible_node" and u.filtered == {"host_mode": 1}
    assert "1 in a host mode that does not serve this shape" in u.reason
    async with pool.acquire() as conn, conn.transaction():
        # The re-check under the node lock refuses it too, whatever a stale candidate list said.
        assert await inv.try_claim_baremetal(conn, HOST, uuid.uuid4(), "t1", wait=True) is None
    # It still takes slices.
    assert (await run_place(pool, accepted(2))).placed.node_id == HOST


@pytest.mark.parametrize("status", ["available", "disabled", "cleanup_blocked"])
async def test_one_unretired_slot_in_any_status_keeps_a_baremetal_host_out(pool, convertible, status):
    # Hand edits past the guards: baremetal mode while one slot still promises its GPU and disk.
    async with pool.acquire() as conn:
        await conn.execute("UPDATE nodes SET mode = 'baremetal'")
        await conn.execute(
            "UPDATE node_resource_slots SET status = CASE WHEN slot_id = $1 THEN $2 ELSE 'retired' END",
            f"{HOST}-s0",
            status,
        )
    u = (await run_place(pool, accepted(shape="baremetal"))).unschedulable
    assert u.filtered == {"approved_slots": 1}
    async with pool.acquire() as conn, conn.transaction():
        assert await inv.try_claim_baremetal(conn, HOST, uuid.uuid4(), "t1", wait=True) is None
        await conn.execute("UPDATE node_resource_slots SET status = 'retired'")
    bm = (await run_place(pool, accepted(shape="baremetal"))).placed
    assert bm.node_id == HOST and bm.claim_mode == "node_exclusive"


# --- slice → baremetal ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "violation,needle",
    [
        ("not_drained", "drain it first"),
        ("live_claim", "live claim(s) on the host"),
        ("unretired_slot", "1 approved slot(s) not retired"),
    ],
)
async def test_slice_to_baremetal_is_refused_naming_the_broken_rule(pool, api, convertible, violation, needle):
    held = (await run_place(pool, accepted(1))).placed if violation == "live_claim" else None
    if violation != "not_drained":
        assert (await set_mode(api, "drained", "make room for a baremetal tenant"))[0] == 200
    idle = [f"{HOST}-s{i}" for i in range(8) if not held or f"{HOST}-s{i}" != held.slots[0].slot_id]
    status, _ = await post(
        api,
        f"/v1/nodes/{HOST}/slots/retire",
        {"actor": "ops", "reason": "convert", "slot_ids": idle[1:] if violation == "unretired_slot" else idle},
    )
    assert status == 200
    before = (await node_row(pool))["mode"], len(await history(pool))

    status, body = await set_mode(api, "baremetal")

    assert status == 409 and body["error"]["code"] == "mode_transition_refused"
    details = body["error"]["details"]
    assert details["to"] == "baremetal" and any(needle in p for p in details["problems"]), details
    assert needle in body["error"]["message"]
    # Refused means nothing written, and the host is still no baremetal candidate.
    assert ((await node_row(pool))["mode"], len(await history(pool))) == before
    assert (await run_place(pool, accepted(shape="baremetal"))).placed is None


async def test_retiring_refuses_slots_under_a_live_claim_or_awaiting_a_wipe(pool, api, convertible):
    held = (await run_place(pool, accepted(1))).placed
    async with pool.acquire() as conn:
        await conn.execute("UPDATE node_resource_slots SET status = 'cleanup_blocked' WHERE slot_id = $1", f"{HOST}-s7")
    status, body = await post(api, f"/v1/nodes/{HOST}/slots/retire", {"actor": "ops", "reason": "convert"})
    assert status == 409 and body["error"]["code"] == "slot_in_use"
    assert body["error"]["details"]["slots"] == {held.slots[0].slot_id: "reserved", f"{HOST}-s7": "cleanup_blocked"}
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM node_resource_slots WHERE status = 'retired'") == 0


async def test_drain_retire_convert_records_who_why_when_and_only_then_serves_baremetal(pool, api, convertible):
    held = (await run_place(pool, accepted(2))).placed
    status, body = await set_mode(api, "drained", "tenant A needs a whole host")
    assert status == 200 and body["mode"] == "drained" and body["mode_changed_by"] == "ops"
    assert body["history"][0]["from_mode"] == "slice" and body["history"][0]["reason"] == "tenant A needs a whole host"
    # Drained: the live slice runs on, nothing new lands.
    await assert_no_slice_lands(pool)
    assert (await run_place(pool, accepted(shape="baremetal"))).unschedulable.filtered == {"host_mode": 1}
    body = await (await api.get(f"/v1/nodes/{HOST}/mode", headers=AUTH)).json()  # what each way out still needs
    assert set(body["transitions"]) == {"slice", "baremetal", "converting", "retired"}
    assert len(body["transitions"]["baremetal"]) == 2  # the live claim and the unretired slots

    await release(pool, held.allocation_id)
    assert (await post(api, f"/v1/nodes/{HOST}/slots/retire", {"actor": "ops", "reason": "to baremetal"}))[0] == 200
    status, body = await set_mode(api, "baremetal", "tenant A needs a whole host")
    assert status == 200 and body["mode"] == "baremetal"
    assert [(h["from_mode"], h["to_mode"]) for h in await history(pool)][-2:] == [
        ("slice", "drained"),
        ("drained", "baremetal"),
    ]
    assert all(h["actor"] == "ops" and h["at"] is not None for h in (await history(pool))[-2:])
    bm = (await run_place(pool, accepted(shape="baremetal"))).placed
    assert bm.node_id == HOST
    await assert_no_slice_lands(pool)
    # Registration cannot bypass the table.
    status, body = await post(
        api,
        "/v1/nodes",
        {
            "actor": "ops",
            "node_id": HOST,
            "kind": "slice_host",
            "hostname": HOST,
            "sku": SKU,
            "mode": "slice",
            "maas_tags": [inv.TAG_SLICE, inv.TAG_BAREMETAL],
        },
    )
    assert status == 409 and body["error"]["code"] == "mode_transition_refused"
    assert (await node_row(pool))["mode"] == "baremetal"


# --- back from baremetal ----------------------------------------------------------------------------


def topology(at):
    """Rediscovery of the host as the agent reports it (same GPUs, clean disks after the release)."""
    nvme, cands = [], []
    for s in range(8):
        r = synthetic.slot_row(HOST, 1, s)
        nvme.append(
            m.NvmeDevice(
                kernel_name=f"nvme{s}n1",
                by_id=r["nvme_by_id"],
                size_bytes=3_840_000_000_000,
                mounted=False,
                is_os_disk=False,
                signatures=[],
                candidate=True,
            )
        )
        cands.append(
            m.CandidateSlot(
                index=s,
                gpu_pci_address=r["gpu_pci_address"],
                numa_node=r["numa_node"],
                pcie_switch=r["pcie_switch"],
                nvme_by_id=r["nvme_by_id"],
                fabric_vf_pci_address=r["fabric_vf_pci_address"],
                mac=r["mac"],
                private_ip=r["private_ip"],
                ovs_bridge="ovsbr0",
                ovs_port=f"vf{s}",
                complete=True,
            )
        )
    return m.NodeTopologyReported(
        node_id=HOST,
        discovered_at=at,
        nvme=nvme,
        candidate_slots=cands,
        hugepages_1g_total=512,
        hugepages_1g_free=512,
    )


def parity(at, failures=0):
    checks = [m.ParityCheck(check="vfio", status="FAIL" if failures else "PASS", detail="GPUs on vfio-pci")]
    return m.NodeParityReported(node_id=HOST, checked_at=at, checks=checks, failures=failures, warnings=0)


async def deliver(pool, fn, ev):
    async with pool.acquire() as conn, conn.transaction():
        return await fn(scheduler_repositories(conn), ev)


@pytest.fixture
async def back_from_baremetal(pool, api, convertible):
    """The host converted, deployed for a baremetal tenant and released: the reset time."""
    await to_baremetal(api)
    bm = (await run_place(pool, accepted(shape="baremetal"))).placed
    assert bm.node_id == HOST
    await release(pool, bm.allocation_id)
    row = await node_row(pool)
    assert row["mode"] == "converting"
    return row["evidence_reset_at"], bm.allocation_id


async def test_a_host_back_from_baremetal_is_converting_with_evidence_unknown(pool, api, back_from_baremetal):
    reset_at, allocation_id = back_from_baremetal
    row = await node_row(pool)
    assert row["parity_failures"] is None and row["parity_checked_at"] is None
    assert row["topology_reported_at"] is None and reset_at is not None
    # Hugepage capacity is topology evidence too: the redeployed host may have booted without them.
    assert row["hugepages_1g_total"] is None and row["hugepages_1g_free"] is None
    last = (await history(pool))[-1]
    assert (last["from_mode"], last["to_mode"], last["actor"], last["allocation_id"]) == (
        "baremetal",
        "converting",
        "scheduler",
        allocation_id,
    )
    assert "MAAS redeployed" in last["reason"]
    async with pool.acquire() as conn:
        # Its old candidates (approved ones included) carried the old disk evidence: gone.
        assert await conn.fetchval("SELECT count(*) FROM candidate_slots") == 0
    # Converting serves neither shape.
    await assert_no_slice_lands(pool)
    assert (await run_place(pool, accepted(shape="baremetal"))).unschedulable.filtered == {"host_mode": 1}
    # Reports from before the reset describe the host before MAAS redeployed it.
    assert await deliver(pool, evidence.record_topology, topology(reset_at - timedelta(minutes=5))) == "stale"
    assert await deliver(pool, evidence.record_parity, parity(reset_at - timedelta(minutes=5))) == "stale"
    assert (await node_row(pool))["parity_failures"] is None


async def test_rediscovery_parity_and_reapproval_return_it_to_slices(pool, api, back_from_baremetal):
    reset_at, _ = back_from_baremetal
    assert await deliver(pool, evidence.record_topology, topology(reset_at + timedelta(minutes=1))) == "applied"
    await assert_no_slice_lands(pool)
    assert await deliver(pool, evidence.record_parity, parity(reset_at + timedelta(minutes=2))) == "applied"
    await assert_no_slice_lands(pool)

    status, body = await post(api, f"/v1/nodes/{HOST}/candidates/approve", {"actor": "alice", "reason": "re-approved"})

    assert status == 200 and body["mode"] == "slice" and "mode_blockers" not in body
    # A baremetal tenant had the disks: approved awaiting the host's wipe proof (issue 38; the proof's way to
    # `available` and to placement is tests/integration/test_scheduler_slot_wipe.py).
    assert {r["status"] for r in body["results"]} == {"awaiting_wipe"}
    last = (await history(pool))[-1]
    assert (last["from_mode"], last["to_mode"], last["actor"], last["reason"]) == (
        "converting",
        "slice",
        "alice",
        "re-approved",
    )
    assert (await run_place(pool, accepted(4))).placed is None


@pytest.mark.parametrize("missing", ["rediscovery", "parity", "failing_parity", "reapproval", "hand_revived_slot"])
async def test_a_converting_host_takes_no_slice_while_a_step_is_missing(pool, api, back_from_baremetal, missing):
    reset_at, _ = back_from_baremetal
    if missing == "rediscovery":
        # Candidates typed in by hand are no rediscovery of the host.
        cands = [
            {
                "candidate_id": f"manual-{s}",
                **{
                    k: v
                    for k, v in synthetic.slot_row(HOST, 1, s).items()
                    if k
                    in (
                        "gpu_pci_address",
                        "numa_node",
                        "pcie_switch",
                        "nvme_by_id",
                        "fabric_claim_mode",
                        "fabric_vf_pci_address",
                        "mac",
                        "private_ip",
                    )
                },
                "nvme_evidence": synthetic.SIMULATED_CLEAN_DISK,
            }
            for s in range(8)
        ]
        assert (await post(api, f"/v1/nodes/{HOST}/candidates", {"actor": "ops", "candidates": cands}, method="PUT"))[
            0
        ] == 200
    else:
        await deliver(pool, evidence.record_topology, topology(reset_at + timedelta(minutes=1)))
    if missing != "parity":
        failures = 2 if missing == "failing_parity" else 0
        await deliver(pool, evidence.record_parity, parity(reset_at + timedelta(minutes=2), failures))
    if missing == "hand_revived_slot":
        async with pool.acquire() as conn:
            await conn.execute("UPDATE node_resource_slots SET status = 'available' WHERE slot_id = $1", f"{HOST}-s7")
    if missing != "reapproval":
        ids = (
            None
            if missing != "hand_revived_slot"
            else [f"{HOST}-{synthetic.slot_row(HOST, 1, s)['gpu_pci_address']}" for s in range(7)]
        )
        status, body = await post(
            api,
            f"/v1/nodes/{HOST}/candidates/approve",
            {"actor": "alice", "candidate_ids": ids} if ids else {"actor": "alice"},
        )
        if missing in ("parity", "failing_parity"):
            # The approval gate itself refuses: no passing parity run for the host's current evidence.
            assert status == 409 and body["error"]["code"] == "readiness_gate", body
            assert "parity" in body["error"]["details"]["gates"]
        else:
            assert status == 200 and body["mode"] == "converting" and body["mode_blockers"]

    assert (await node_row(pool))["mode"] == "converting"
    await assert_no_slice_lands(pool)
    status, body = await set_mode(api, "slice", "try anyway")
    assert status == 409
    needle = {
        "rediscovery": "no topology report",
        "parity": "no parity run",
        "failing_parity": "2 failure(s)",
        "reapproval": "no slot re-approved",
        "hand_revived_slot": "approved before the evidence reset",
    }[missing]
    assert any(needle in p for p in body["error"]["details"]["problems"]), body


async def test_a_baremetal_only_host_goes_back_to_the_baremetal_pool(pool):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=0, baremetal_hosts=1)
    first = (await run_place(pool, accepted(shape="baremetal"))).placed
    await release(pool, first.allocation_id)
    assert (await node_row(pool, "bm00001"))["mode"] == "baremetal"
    assert (await run_place(pool, accepted(shape="baremetal"))).placed.node_id == "bm00001"


async def test_approval_is_refused_on_a_baremetal_host(pool, api, convertible):
    await to_baremetal(api)
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO candidate_slots (candidate_id, node_id, gpu_pci_address) VALUES ('c', $1, '0000:18:00.0')",
            HOST,
        )
    status, body = await post(api, f"/v1/nodes/{HOST}/candidates/approve", {"actor": "ops"})
    assert status == 409 and body["error"]["code"] == "mode_forbids_approval"
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM node_resource_slots WHERE status <> 'retired'") == 0


# --- the migration ------------------------------------------------------------------------------------


async def test_the_migration_derives_existing_hosts_modes(fresh_db):
    conn = await asyncpg.connect(fresh_db, server_settings={"search_path": "scheduler"})
    try:
        # Apply everything before 004, as a database from before host modes.
        await conn.execute("CREATE SCHEMA scheduler")
        await conn.execute(
            "CREATE TABLE scheduler.schema_migrations (version text PRIMARY KEY, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute("INSERT INTO scheduler.schema_migrations (version) VALUES ('004_host_modes')")
        await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
        await synthetic.build(conn, slice_hosts=3, convertible=True, baremetal_hosts=1, sku=SKU)
        # n00002: a baremetal tenant on a slice-mode host (what today's code allowed);
        # n00003: only the baremetal tag left, mode still 'slice'.
        await conn.execute(
            "INSERT INTO allocation_resource_claims (allocation_id, node_id, claim_kind, status, "
            "fencing_epoch) VALUES ($1, 'n00002', 'node_exclusive', 'held', 1)",
            uuid.uuid4(),
        )
        await conn.execute("UPDATE nodes SET maas_tags = '{gpuaas-profile-baremetal}' WHERE node_id = 'n00003'")
        await conn.execute("DELETE FROM scheduler.schema_migrations WHERE version = '004_host_modes'")

        assert await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations") == ["004_host_modes"]

        modes = dict(await conn.fetch("SELECT node_id, mode FROM nodes"))
        assert modes == {"n00001": "slice", "n00002": "baremetal", "n00003": "baremetal", "bm00001": "baremetal"}
        statuses = dict(
            await conn.fetch("SELECT node_id, array_agg(DISTINCT status) FROM node_resource_slots GROUP BY node_id")
        )
        assert statuses["n00002"] == ["retired"] and statuses["n00001"] == ["available"]
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM slot_transitions WHERE to_status = 'retired' AND actor = 'migration-004'"
            )
            == 8 + 8
        )
        rows = {r["node_id"]: r for r in await conn.fetch("SELECT * FROM node_mode_history")}
        assert set(rows) == set(modes) and rows["n00002"]["from_mode"] == "slice"
        assert rows["n00001"]["from_mode"] is None and rows["n00001"]["actor"] == "migration-004"
    finally:
        await conn.close()


# --- the VFIO binding follows the mode (issue 26, point 5) -------------------------------------------


async def vfio_asks(pool, node=HOST) -> list[dict]:
    """The slice.vfio_apply tasks in the scheduler's outbox for `node`, each checked against the contract."""
    validator = default_validator()
    subject = f"gpuaas.node.{node}.tasks.slice.vfio_apply"
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT subject, body FROM outbox WHERE subject = $1 ORDER BY id", subject)
    out = [validator.validate(r["subject"], bytes(r["body"])) for r in rows]
    return [e for e in out if e["type"] == "slice.vfio_apply"]


async def test_entering_slice_mode_binds_the_approved_devices_and_leaving_it_releases_them(pool, api, convertible):
    async with pool.acquire() as conn:
        approved = await conn.fetch(
            "SELECT slot_id, gpu_pci_address, fabric_vf_pci_address FROM node_resource_slots WHERE node_id = $1 "
            "ORDER BY slot_id",
            HOST,
        )
    assert approved and all(r["gpu_pci_address"] for r in approved)
    # slice → drained keeps the binding: live slices run there to their end.
    assert (await set_mode(api, "drained", "maintenance"))[0] == 200
    assert await vfio_asks(pool) == []
    # drained → slice: bind exactly the approved slots' devices.
    status, body = await set_mode(api, "slice", "maintenance done")
    assert status == 200, body
    [bind] = await vfio_asks(pool)
    assert bind["payload"]["action"] == "bind" and bind["payload"]["node_id"] == HOST
    assert [(s["slot_id"], s["gpu_pci_address"], s["fabric_vf_pci_address"]) for s in bind["payload"]["slots"]] == [
        (r["slot_id"], r["gpu_pci_address"], r["fabric_vf_pci_address"]) for r in approved
    ]
    assert body["mode"] == "slice"
    # Leaving for baremetal (drain, retire, baremetal): the host releases every device it had bound.
    await to_baremetal(api)
    unbind = (await vfio_asks(pool))[-1]
    assert unbind["payload"]["action"] == "unbind"
    assert sorted(s["gpu_pci_address"] for s in unbind["payload"]["slots"]) == sorted(
        r["gpu_pci_address"] for r in approved
    )
    assert len(await vfio_asks(pool)) == 2


async def test_a_refused_mode_change_asks_no_binding(pool, api, convertible):
    status, _ = await set_mode(api, "baremetal", "skip the drain")
    assert status == 409
    assert await vfio_asks(pool) == []


async def test_reapproval_that_returns_a_host_to_slices_binds_what_was_approved(pool, api, back_from_baremetal):
    reset_at, _ = back_from_baremetal
    before = len(await vfio_asks(pool))
    assert await deliver(pool, evidence.record_topology, topology(reset_at + timedelta(minutes=1))) == "applied"
    assert await deliver(pool, evidence.record_parity, parity(reset_at + timedelta(minutes=2))) == "applied"
    status, body = await post(api, f"/v1/nodes/{HOST}/candidates/approve", {"actor": "alice", "reason": "re-approved"})
    assert status == 200 and body["mode"] == "slice"
    asks = await vfio_asks(pool)
    assert len(asks) == before + 1 and asks[-1]["payload"]["task_id"] == body["vfio_task"]
    bound = {s["slot_id"] for s in asks[-1]["payload"]["slots"]}
    # Slots awaiting their host's wipe proof are approved: bound now, placed once the proof passes.
    assert bound == {r["slot_id"] for r in body["results"] if r["status"] in ("available", "awaiting_wipe")}


# --- every mode change is announced (the image pipeline's gate, ops' history) ----------------------------


async def mode_changes(pool, node=HOST) -> list[dict]:
    """The scheduler.host_mode_changed events in the outbox for `node`, each checked against the contract."""
    validator = default_validator()
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT subject, body FROM outbox WHERE subject = 'gpuaas.scheduler.host.mode_changed' ORDER BY id"
        )
    out = [validator.validate(r["subject"], bytes(r["body"]))["payload"] for r in rows]
    return [p for p in out if p["node_id"] == node]


async def test_each_mode_change_is_announced_with_who_and_why_and_a_refused_one_is_not(pool, api, convertible):
    assert (await set_mode(api, "baremetal", "skip the drain"))[0] == 409
    assert await mode_changes(pool) == []
    await to_baremetal(api)
    changes = await mode_changes(pool)
    assert [(c["from_mode"], c["to_mode"]) for c in changes] == [("slice", "drained"), ("drained", "baremetal")]
    assert all(c["actor"] == "ops" and c["reason"] == "tenant needs a whole host" for c in changes)


async def test_reapproval_that_returns_a_host_to_slices_announces_it(pool, api, back_from_baremetal):
    reset_at, _ = back_from_baremetal
    assert await deliver(pool, evidence.record_topology, topology(reset_at + timedelta(minutes=1))) == "applied"
    assert await deliver(pool, evidence.record_parity, parity(reset_at + timedelta(minutes=2))) == "applied"
    status, body = await post(api, f"/v1/nodes/{HOST}/candidates/approve", {"actor": "alice", "reason": "re-approved"})
    assert status == 200 and body["mode"] == "slice"
    last = (await mode_changes(pool))[-1]
    assert (last["from_mode"], last["to_mode"], last["actor"]) == ("converting", "slice", "alice")
