"""Hosts an operator can steer (issue 26, point 5), over real Postgres and the scheduler's admin HTTP API:
rediscovery, parity and commissioning asked on demand go out as contract-valid commands through the outbox, the
host's report closes the ask with what it found, and `GET /v1/nodes/{id}` lists it; bad asks are refused with
every reason and leave nothing behind; the scheduler asks parity itself after a mode change and periodically,
once across replicas, and closes asks nobody answered."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.repository import scheduler_repositories
from gpuaas_scheduler.service_layer import evidence, steering

from .scheduler_db import ADMIN_AUTH, admin_client, scheduler_pool

HOST = "n00001"
POLICY = steering.SteeringPolicy(task_deadline_s=300, parity_interval_s=None)


@pytest.fixture
async def pool(fresh_db):
    async with scheduler_pool(fresh_db) as p:
        async with p.acquire() as conn:
            await synthetic.build(conn, slice_hosts=2, slots_per_host=2)
        yield p


@pytest.fixture
async def api(pool):
    async with admin_client(pool) as client:
        yield client


async def post(api, path, body=None):
    body = body if body is not None else {"actor": "ops", "reason": "host looked odd"}
    resp = await api.post(path, json=body, headers={**ADMIN_AUTH, "Idempotency-Key": uuid.uuid4().hex})
    return resp.status, await resp.json()


async def node_doc(api, node=HOST):
    resp = await api.get(f"/v1/nodes/{node}", headers=ADMIN_AUTH)
    assert resp.status == 200
    return await resp.json()


async def commands(pool, subject_like="gpuaas.%"):
    """The outbox's commands, each checked against the contract on its subject."""
    validator = default_validator()
    rows = await pool.fetch(
        "SELECT subject, body FROM outbox WHERE subject LIKE $1 AND subject NOT LIKE 'gpuaas.scheduler.%' ORDER BY id",
        subject_like,
    )
    return [(r["subject"], validator.validate(r["subject"], bytes(r["body"]))) for r in rows]


def parity_report(task_id, failures=0, node=HOST):
    checks = [m.ParityCheck(check="kvm", status="PASS", detail="/dev/kvm")]
    checks += [m.ParityCheck(check="vfio_binding", status="FAIL", detail="0000:18:00.0 bound to nvidia")] * failures
    return m.NodeParityReported(
        node_id=node, task_id=task_id, checked_at=datetime.now(UTC), checks=checks, failures=failures, warnings=0
    )


async def answer_parity(pool, report):
    async with pool.acquire() as conn, conn.transaction():
        applied = await evidence.record_parity(scheduler_repositories(conn), report)
        return await steering.parity_answered(scheduler_repositories(conn).asks, report, applied)


async def sweep(pool, policy=POLICY):
    return await steering.sweep(lambda: UnitOfWork(pool, "scheduler", "scheduler", scheduler_repositories), policy)


async def test_parity_on_demand_goes_to_the_host_and_its_report_lands_on_the_nodes_history(pool, api) -> None:
    status, doc = await post(api, f"/v1/nodes/{HOST}/parity")
    assert status == 200, doc
    ask = doc["action"]
    assert (ask["kind"], ask["status"], ask["actor"], ask["reason"]) == (
        "parity",
        "requested",
        "ops",
        "host looked odd",
    )
    [(subject, env)] = await commands(pool)
    assert subject == f"gpuaas.node.{HOST}.tasks.slice.parity_check" and env["type"] == "slice.parity_check"
    assert env["payload"]["task_id"] == ask["action_id"] and env["payload"]["node_id"] == HOST
    # A second ask while the first is open would only race its report.
    status, refused = await post(api, f"/v1/nodes/{HOST}/parity")
    assert status == 409 and refused["error"]["code"] == "ask_refused"
    assert ask["action_id"] in refused["error"]["details"]["problems"][0]
    assert len(await commands(pool)) == 1

    # Another host naming the ask's id cannot answer it.
    assert await answer_parity(pool, parity_report(ask["action_id"], node="n00002")) is None
    assert (await node_doc(api))["actions"][0]["status"] == "requested"

    assert await answer_parity(pool, parity_report(ask["action_id"], failures=1)) == "parity"
    [done] = (await node_doc(api))["actions"]
    assert done["status"] == "failed" and "vfio_binding" in done["outcome"], done
    assert done["result"]["parity"]["failed_checks"] == ["vfio_binding"] and done["finished_at"]
    audit = await pool.fetchrow("SELECT actor, reason, detail FROM admin_audit WHERE action = 'node.parity'")
    assert audit["actor"] == "ops" and json.loads(audit["detail"])["action_id"] == ask["action_id"]

    # Closed: the next ask goes out, and a passing report closes it succeeded.
    status, doc = await post(api, f"/v1/nodes/{HOST}/parity")
    assert status == 200
    await answer_parity(pool, parity_report(doc["action"]["action_id"]))
    latest = (await node_doc(api))["actions"][0]
    assert (latest["status"], latest["outcome"]) == ("succeeded", "parity passed (0 warning(s))")


async def test_rediscovery_is_settled_by_the_topology_and_keeps_the_parity_it_ran(pool, api) -> None:
    status, doc = await post(api, f"/v1/nodes/{HOST}/rediscover")
    assert status == 200, doc
    task_id = doc["action"]["action_id"]
    [(_, env)] = await commands(pool)
    assert env["type"] == "slice.topology_discover" and env["payload"]["task_id"] == task_id
    await answer_parity(pool, parity_report(task_id))
    assert (await node_doc(api))["actions"][0]["status"] == "requested"  # parity alone does not settle it
    topo = m.NodeTopologyReported(
        node_id=HOST, task_id=task_id, discovered_at=datetime.now(UTC), blockers=["GPU 0000:18:00.0 has no free VF"]
    )
    async with pool.acquire() as conn, conn.transaction():
        await steering.topology_answered(
            scheduler_repositories(conn).asks, topo, await evidence.record_topology(scheduler_repositories(conn), topo)
        )
    [done] = (await node_doc(api))["actions"]
    assert done["status"] == "failed" and "no free VF" in done["outcome"]
    assert set(done["result"]) == {"topology", "parity"} and done["result"]["parity"]["verdict"] == "succeeded"


@pytest.mark.parametrize(
    ("path", "prepare", "status", "expected"),
    [
        ("/v1/nodes/nope/rediscover", None, 404, "node_not_found"),
        (f"/v1/nodes/{HOST}/parity", "UPDATE nodes SET mode = 'baremetal'", 409, "is baremetal"),
        (f"/v1/nodes/{HOST}/rediscover", "UPDATE nodes SET mode = 'retired'", 409, "is retired"),
        (f"/v1/nodes/{HOST}/commission", None, 409, "no MAAS machine"),
        (f"/v1/nodes/{HOST}/commission", "UPDATE nodes SET maas_system_id = 'abc123'", 409, "takes placements"),
    ],
)
async def test_a_bad_ask_is_refused_with_its_reason_and_changes_nothing(
    pool, api, path, prepare, status, expected
) -> None:
    if prepare:
        await pool.execute(prepare + " WHERE node_id = $1", HOST)
    got, doc = await post(api, path)
    assert got == status, doc
    assert expected in json.dumps(doc["error"])
    assert await pool.fetchval("SELECT count(*) FROM node_actions") == 0
    assert await commands(pool) == []
    assert await pool.fetchval("SELECT count(*) FROM admin_audit WHERE action LIKE 'node.%'") == 0
    # The body is checked too: no reason, no ask.
    got, doc = await post(api, f"/v1/nodes/{HOST}/parity", {"actor": "ops"})
    assert got == 422 and await pool.fetchval("SELECT count(*) FROM node_actions") == 0


async def test_commissioning_goes_to_the_maas_gateway_and_the_preflight_closes_it(pool, api) -> None:
    await pool.execute(
        "UPDATE nodes SET maas_system_id = 'abc123', draining = true, drain_reason = 'x' WHERE node_id = $1", HOST
    )
    status, doc = await post(api, f"/v1/nodes/{HOST}/commission")
    assert status == 200, doc
    op = doc["action"]["action_id"]
    [(subject, env)] = await commands(pool)
    assert subject == "gpuaas.maas.command.commission"
    sent = env["payload"]
    assert (sent["operation_id"], sent["system_id"], sent["node_id"], sent["site"]) == (op, "abc123", HOST, "default")
    assert env["payload"]["commissioning_scripts"] == ["50-gpuaas-slice-firmware-preflight"]
    report = m.NodeSlicePreflightReported(
        operation_id=op,
        site="default",
        system_id="abc123",
        node_id=HOST,
        script_name="50-gpuaas-slice-firmware-preflight",
        status="failed",
        reasons=["IOMMU off in firmware"],
        reported_at=datetime.now(UTC),
    )
    async with pool.acquire() as conn, conn.transaction():
        await evidence.record_slice_preflight(scheduler_repositories(conn), report)
        assert await steering.preflight_answered(scheduler_repositories(conn).asks, report) == "commission"
    done = (await node_doc(api))["actions"][0]
    assert done["status"] == "failed" and "IOMMU off in firmware" in done["outcome"]


async def test_the_scheduler_asks_parity_after_a_mode_change_once_across_replicas(pool, api) -> None:
    assert await sweep(pool) == {"expired": 0, "parity_asked": 0, "wipes_reasked": 0}  # nothing changed since seeding
    resp = await api.post(
        f"/v1/nodes/{HOST}/mode",
        json={"actor": "ops", "mode": "drained", "reason": "maintenance window"},
        headers={**ADMIN_AUTH, "Idempotency-Key": uuid.uuid4().hex},
    )
    assert resp.status == 200, await resp.json()
    # Two replicas' sweeps at once: one ask between them.
    results = await asyncio.gather(sweep(pool), sweep(pool))
    assert sum(r["parity_asked"] for r in results) == 1
    [(subject, env)] = await commands(pool)
    assert subject == f"gpuaas.node.{HOST}.tasks.slice.parity_check" and env["type"] == "slice.parity_check"
    ask = (await node_doc(api))["actions"][0]
    assert ask["actor"] == "scheduler" and "mode changed" in ask["reason"]
    await answer_parity(pool, parity_report(ask["action_id"]))
    assert (await sweep(pool))["parity_asked"] == 0  # answered, and the mode has not changed since


async def test_periodic_parity_and_unanswered_asks_expire(pool, api) -> None:
    # Both hosts' last reports are older than the interval.
    await pool.execute("UPDATE nodes SET parity_reported_at = now() - interval '2 hours'")
    policy = steering.SteeringPolicy(task_deadline_s=300, parity_interval_s=3600)
    assert (await sweep(pool, policy))["parity_asked"] == 2
    assert (await sweep(pool, policy))["parity_asked"] == 0  # asked: not again before the interval
    # Nobody answers: past its deadline the ask is closed expired, with why.
    await pool.execute("UPDATE node_actions SET deadline = now() - interval '1 second' WHERE node_id = $1", HOST)
    assert (await sweep(pool, policy))["expired"] == 1
    expired = (await node_doc(api))["actions"][0]
    assert expired["status"] == "expired" and "did not answer" in expired["outcome"]
    # A late report still lands on the ask's result, but cannot reopen or re-settle it.
    await answer_parity(pool, parity_report(expired["action_id"]))
    late = (await node_doc(api))["actions"][0]
    assert late["status"] == "expired" and late["result"]["parity"]["verdict"] == "succeeded"
