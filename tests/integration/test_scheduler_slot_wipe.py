"""Every disk that changes tenant is proven clean by its own host (issue 38, point 1), over real Postgres, the
scheduler's admin HTTP API and its bus handler with a real unit of work:

(a) a host back from a baremetal tenancy (converting) re-approves its slots `awaiting_wipe`, never `available`;
    nothing lands there until the host's own wipe report (on its report subject) passes the site's policy;
(b) a wipe proof typed into a repair body is refused with one problem detail and changes nothing;
(c) repair of a cleanup_blocked slot sends the host a `slice.slot_wipe` task and frees the slot only on that
    host's passing proof; a failing proof, a report from another host's subject, or one for an older task, frees
    nothing;
(d) a wipe task past its deadline unanswered is asked again by the steering sweep, a bounded number of slots a
    round, the old ask closed `expired` (its late report frees nothing).
Every task the scheduler sends and every report it takes is validated against the contract."""

# ruff: noqa: F811 - the host-mode tests' fixtures, imported by name, are parameters here
from __future__ import annotations

from datetime import timedelta

import pytest

from gpuaas_common.bus import PermanentError
from gpuaas_common.bus_dispatch import HandlerContext
from gpuaas_common.bus_dispatch import deliver as bus_deliver
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.contract.catalog import spec_for
from gpuaas_common.contract.envelope import Envelope
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.service_layer import evidence, steering
from gpuaas_scheduler.service_layer.handlers import Scheduler
from gpuaas_scheduler.service_layer.slot_wipe import WIPE_REASK_GRACE_S, WIPE_TASK_DEADLINE_S
from gpuaas_scheduler.service_layer.steering import SteeringPolicy

from .scheduler_db import place_and_activate, post, slot_rows
from .test_scheduler_host_modes import (  # noqa: F401 - the fixtures of the host-mode tests
    HOST,
    accepted,
    api,
    back_from_baremetal,
    convertible,
    deliver,
    parity,
    pool,
    run_place,
    topology,
)


async def wipe_tasks(pool, node=HOST) -> list[dict]:
    """The slice.slot_wipe tasks in the scheduler's outbox for `node`, each validated against the contract."""
    validator = default_validator()
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT subject, body FROM outbox WHERE subject = $1 ORDER BY id",
            f"gpuaas.node.{node}.tasks.slice.slot_wipe",
        )
    out = [validator.validate(r["subject"], bytes(r["body"])) for r in rows]
    return [e["payload"] for e in out if e["type"] == "slice.slot_wipe"]


def report_of(task: dict, *, method="blkdiscard", verified=True, signatures=(), node=HOST) -> m.NodeSlotWipeReported:
    outcomes = [
        m.SlotWipeOutcome(
            slot_id=s["slot_id"],
            device=s["nvme_by_id"],
            proof=m.WipeProof(
                device=s["nvme_by_id"],
                method=method,
                verified=verified,
                signatures=list(signatures),
                verification="wipefs and blkid find nothing; 64 sampled blocks read back as zeros",
            ),
        )
        for s in task["slots"]
    ]
    return m.NodeSlotWipeReported(task_id=task["task_id"], node_id=node, outcomes=outcomes)


async def host_reports(pool, report: m.NodeSlotWipeReported, *, subject_node=HOST) -> bool:
    """The report through the scheduler's handler in a real unit of work, as it arrives on `subject_node`'s
    report subject (the subject a host's identity may publish on is its own)."""
    body = report.model_dump(mode="json")
    subject = spec_for("node.slot_wipe_reported").subject(node_id=subject_node)
    env = Envelope.wrap("node.slot_wipe_reported", body, producer="node-agent", correlation_id=report.task_id)
    default_validator().validate(subject, env.model_dump_json().encode())
    ctx = HandlerContext(env, report, subject, "scheduler-node-slot-wipes", 1)
    uow = UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories)
    return await bus_deliver(Scheduler().on_slot_wipe, ctx, uow)


async def statuses(pool, ids) -> set[str]:
    return {r["status"] for r in (await slot_rows(pool, list(ids))).values()}


# --- (a) the converting walk's re-approval ---------------------------------------------------------------------


async def test_a_host_back_from_baremetal_reapproves_awaiting_wipe_and_serves_slices_only_after_its_proof(
    pool, api, back_from_baremetal
):
    reset_at, _ = back_from_baremetal
    assert await deliver(pool, evidence.record_topology, topology(reset_at + timedelta(minutes=1))) == "applied"
    assert await deliver(pool, evidence.record_parity, parity(reset_at + timedelta(minutes=2))) == "applied"

    status, body = await post(api, f"/v1/nodes/{HOST}/candidates/approve", {"actor": "alice", "reason": "re-approved"})

    assert status == 200, body
    # A baremetal tenant had every disk: approved, but not placeable until the host proves the site's wipe.
    assert {r["status"] for r in body["results"]} == {"awaiting_wipe"}
    assert all(any("converting" in w for w in r["wipe_owed"]) for r in body["results"])
    ids = [r["slot_id"] for r in body["results"]]
    # The host is back in slice mode (its devices bound), yet no slice lands on a slot awaiting its wipe.
    assert body["mode"] == "slice"
    u = (await run_place(pool, accepted(1))).unschedulable
    assert u is not None and u.free_gpus == 0, u
    [task] = await wipe_tasks(pool)
    assert task["task_id"] == body["wipe_task"] and sorted(s["slot_id"] for s in task["slots"]) == sorted(ids)
    assert {s["wipe_policy"] for s in task["slots"]} == {"blkdiscard"}

    # The host's passing proof for every disk, on its own report subject: the slots are free, logged with it.
    assert await host_reports(pool, report_of(task))
    assert await statuses(pool, ids) == {"available"}
    status, slot = await api_get(api, f"/v1/slots/{ids[0]}")
    last = slot["transitions"][0]
    assert (last["from_status"], last["to_status"], last["actor"]) == ("awaiting_wipe", "available", f"node:{HOST}")
    assert last["detail"]["wipe_task"] == task["task_id"] and last["detail"]["proof"]["method"] == "blkdiscard"
    assert slot["wipes"][0]["outcome"] == "passed"
    placed = (await run_place(pool, accepted(4))).placed
    assert placed is not None and placed.node_id == HOST


async def test_a_failing_proof_blocks_the_awaiting_slot_and_a_foreign_subject_frees_nothing(
    pool, api, back_from_baremetal
):
    reset_at, _ = back_from_baremetal
    assert await deliver(pool, evidence.record_topology, topology(reset_at + timedelta(minutes=1))) == "applied"
    assert await deliver(pool, evidence.record_parity, parity(reset_at + timedelta(minutes=2))) == "applied"
    status, body = await post(api, f"/v1/nodes/{HOST}/candidates/approve", {"actor": "alice", "reason": "re-approved"})
    assert status == 200, body
    [lost] = await wipe_tasks(pool)
    ids = [s["slot_id"] for s in lost["slots"]]
    # The first task never came back (the host was down past its deadline): a repair asks again, and only the
    # newer task's report counts from here.
    status, again = await post(api, f"/v1/slots/{ids[0]}/repair", {"actor": "ops", "reason": "task lost"})
    assert status == 200 and again["slot"]["status"] == "awaiting_wipe" and again["wipe_task"], again
    [task] = [t for t in await wipe_tasks(pool) if t["task_id"] == again["wipe_task"]]
    assert await host_reports(pool, report_of(lost))  # the lost task's late report: only ids[0] was re-asked
    assert await statuses(pool, ids[:1]) == {"awaiting_wipe"} and await statuses(pool, ids[1:]) == {"available"}
    ids = ids[:1]
    # Another host (whose identity publishes only on its own subject) sends this host's task's proof: refused.
    with pytest.raises(PermanentError) as refused:
        await host_reports(pool, report_of(task), subject_node="slice-other")
    assert refused.value.reason_code == "foreign_wipe_report"
    assert await statuses(pool, ids) == {"awaiting_wipe"}
    # The host's own report, but its wipe left a signature: blocked, never available.
    assert await host_reports(pool, report_of(task, signatures=["ext4"]))
    assert await statuses(pool, ids) == {"cleanup_blocked"}
    for _ in range(8):  # the blocked slot is never placed, whatever else is free
        placed = (await run_place(pool, accepted(1))).placed
        assert placed is None or placed.slots[0].slot_id != ids[0]


async def api_get(api, path):
    from .scheduler_db import ADMIN_AUTH

    resp = await api.get(path, headers=ADMIN_AUTH)
    return resp.status, await resp.json()


# --- (b) and (c): repair of a cleanup_blocked slot --------------------------------------------------------------


async def _blocked_slot(pool):
    from .test_scheduler_host_modes import release  # released with no proof: the disks may hold the tenant's data

    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    placed = await place_and_activate(pool)
    await release(pool, placed.allocation_id, m.CleanupReport(required=True, verified=False))
    slot = placed.slots[0]
    assert await statuses(pool, [slot.slot_id]) == {"cleanup_blocked"}
    return placed.node_id, slot


async def test_a_typed_wipe_proof_in_a_repair_is_refused_and_changes_nothing(pool, api):
    node, slot = await _blocked_slot(pool)
    before = await slot_rows(pool, [slot.slot_id])
    typed = {"device": slot.nvme_by_id, "method": "blkdiscard", "verified": True, "verification": "trust me"}
    status, answer = await post(
        api, f"/v1/slots/{slot.slot_id}/repair", {"actor": "alice", "reason": "wiped", "wipe_proof": typed}
    )
    assert status == 422 and answer["error"]["code"] == "typed_wipe_proof_refused", answer
    assert "only from the slot's own host" in answer["error"]["message"]
    assert await slot_rows(pool, [slot.slot_id]) == before
    assert await wipe_tasks(pool, node) == []


async def test_repair_asks_the_host_to_wipe_and_frees_the_slot_only_on_its_passing_proof(pool, api):
    node, slot = await _blocked_slot(pool)
    status, answer = await post(api, f"/v1/slots/{slot.slot_id}/repair", {"actor": "alice", "reason": "reuse it"})
    assert status == 200, answer
    # Asked, not freed: the slot stays blocked until its host's proof arrives.
    assert answer["slot"]["status"] == "cleanup_blocked" and answer["wipe_task"]
    [first] = await wipe_tasks(pool, node)
    assert first["task_id"] == answer["wipe_task"]
    assert first["slots"] == [{"slot_id": slot.slot_id, "nvme_by_id": slot.nvme_by_id, "wipe_policy": "blkdiscard"}]
    # A second repair asks again; the first task's late proof then frees nothing.
    status, again = await post(api, f"/v1/slots/{slot.slot_id}/repair", {"actor": "alice", "reason": "again"})
    assert status == 200, again
    second = (await wipe_tasks(pool, node))[-1]
    assert await host_reports(pool, report_of(first, node=node), subject_node=node)
    assert await statuses(pool, [slot.slot_id]) == {"cleanup_blocked"}
    # A proof by a method the policy does not accept frees nothing either.
    assert await host_reports(pool, report_of(second, method="nvme_format", node=node), subject_node=node)
    assert await statuses(pool, [slot.slot_id]) == {"cleanup_blocked"}
    status, third = await post(api, f"/v1/slots/{slot.slot_id}/repair", {"actor": "alice", "reason": "third"})
    assert status == 200, third
    assert await host_reports(pool, report_of((await wipe_tasks(pool, node))[-1], node=node), subject_node=node)
    assert await statuses(pool, [slot.slot_id]) == {"available"}
    status, detail = await api_get(api, f"/v1/slots/{slot.slot_id}")
    assert [w["outcome"] for w in detail["wipes"]] == ["passed", "failed", "superseded"]


# --- (d) a wipe ask past its deadline ----------------------------------------------------------------------------


async def steering_sweep(pool, batch: int) -> dict[str, int]:
    policy = SteeringPolicy(sweep_batch=batch)
    return await steering.sweep(lambda: UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories), policy)


async def overdue(pool, slot_ids, seconds: float) -> None:
    """The open asks of these slots as though asked `seconds` ago (the host has been silent that long)."""
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE slot_wipes SET requested_at = now() - make_interval(secs => $2) "
            "WHERE slot_id = ANY($1::text[]) AND closed_at IS NULL",
            list(slot_ids),
            seconds,
        )


async def test_the_sweep_asks_again_a_wipe_past_its_deadline_a_few_slots_a_round(pool, api):
    async with pool.acquire() as conn:
        await synthetic.build(conn, slice_hosts=1)
    status, body = await post(api, "/v1/slots/n00001-s7/disable", {"actor": "ops", "reason": "fan"})
    assert status == 200, body
    await post(api, f"/v1/nodes/{HOST}/drain", {"actor": "ops", "reason": "disk bay", "maintenance": True})
    status, body = await post(api, f"/v1/nodes/{HOST}/undrain", {"actor": "ops", "reason": "done"})
    assert status == 200 and len(body["wipe_asked"]) == 8, body
    [lost] = await wipe_tasks(pool)
    ids = sorted(body["wipe_asked"])
    # Within the deadline (and its grace) nothing is asked again, however long the wipe takes.
    await overdue(pool, ids, WIPE_TASK_DEADLINE_S)
    assert (await steering_sweep(pool, batch=5))["wipes_reasked"] == 0
    assert len(await wipe_tasks(pool)) == 1

    # Past it: the host dropped the task as stale. Five slots this round, the other three the next.
    await overdue(pool, ids, WIPE_TASK_DEADLINE_S + WIPE_REASK_GRACE_S + 60)
    assert (await steering_sweep(pool, batch=5))["wipes_reasked"] == 1
    assert (await steering_sweep(pool, batch=5))["wipes_reasked"] == 1
    assert (await steering_sweep(pool, batch=5))["wipes_reasked"] == 0
    first, second = (await wipe_tasks(pool))[1:]
    assert [s["slot_id"] for s in first["slots"]] == ids[:5] and [s["slot_id"] for s in second["slots"]] == ids[5:]
    assert {s["wipe_policy"] for s in first["slots"] + second["slots"]} == {"blkdiscard"}
    async with pool.acquire() as conn:
        asks = await conn.fetch("SELECT task_id, slot_id, cause, outcome, requested_by FROM slot_wipes ORDER BY 2, 1")
    old = [a for a in asks if a["task_id"] == lost["task_id"]]
    assert [a["outcome"] for a in old] == ["expired"] * 8
    new = [a for a in asks if a["task_id"] != lost["task_id"]]
    assert {(a["cause"], a["outcome"], a["requested_by"]) for a in new} == {("maintenance", None, "scheduler")}
    # The lost task's late report frees nothing; the new tasks' proofs do (the disabled slot stays disabled).
    assert await host_reports(pool, report_of(lost))
    assert await statuses(pool, ids) == {"awaiting_wipe", "disabled"}
    for task in (first, second):
        assert await host_reports(pool, report_of(task))
    assert await statuses(pool, ids[:7]) == {"available"} and await statuses(pool, ids[7:]) == {"disabled"}
    assert (await steering_sweep(pool, batch=5))["wipes_reasked"] == 0
