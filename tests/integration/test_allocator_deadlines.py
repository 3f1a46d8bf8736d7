"""The allocator's task-deadline sweep on real Postgres: SQL, row locks shared with other replicas, the outbox."""

from __future__ import annotations

import json
import uuid

import asyncpg
import pytest

from gpuaas_allocator.adapters.repository import AllocationRepository
from gpuaas_allocator.domain.model import ActiveImage
from gpuaas_allocator.service_layer.deadlines import expire_overdue_tasks
from gpuaas_allocator.service_layer.handlers import Allocator
from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.bus import HandlerContext, PermanentError, deliver
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork

IMAGE = ActiveImage("ubuntu-slice", "slice", "h200-sxm-slice", "a" * 64, "/img/slice.raw")


@pytest.fixture
async def pool(fresh_db):
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator")
    yield pool
    await pool.close()


def _uow(pool: asyncpg.Pool) -> UnitOfWork[AllocationRepository]:
    return UnitOfWork(pool, "allocator", "allocator", AllocationRepository)


async def _send(pool: asyncpg.Pool, handler, type_: str, payload: m.Payload) -> None:
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="c")
    await deliver(handler, HandlerContext(env, payload, "s", "test", 1), _uow(pool))


async def _provisioning(pool: asyncpg.Pool, allocator: Allocator) -> uuid.UUID:
    alloc = uuid.uuid4()
    await _send(
        pool,
        allocator.on_requested,
        "allocation.requested",
        m.AllocationRequested(
            allocation_id=alloc,
            tenant_id="t",
            shape="gpu_slice",
            sku="h200-sxm-slice",
            gpu_count=1,
            image=IMAGE.slug,
            ssh_public_keys=["ssh-ed25519 AAAA k@t"],
        ),
    )
    slot = m.SlotBinding(
        slot_id=f"n1-{alloc.hex[:6]}",
        gpu_pci_address="0000:18:00.0",
        nvme_by_id="nvme-x",
        fabric_vf_pci_address="0000:19:00.2",
        mac="52:54:00:00:00:01",
        private_ip="127.100.0.10",
        ovs_bridge="br-slice",
        profile="h200-slice",
    )
    await _send(
        pool,
        allocator.on_placed,
        "placement.placed",
        m.PlacementPlaced(allocation_id=alloc, node_id="n1", claim_mode="slots", slots=[slot], fencing_epoch=1),
    )
    return alloc


async def test_overdue_tasks_fail_once_skip_locked_rows_and_late_answers_are_recorded(pool) -> None:
    allocator = Allocator(AllocatorSettings())
    async with _uow(pool) as uow:
        await uow.repos.upsert_image(IMAGE)
        await uow.commit()
    silent, held, fresh = [await _provisioning(pool, allocator) for _ in range(3)]
    deadline = await pool.fetchval("SELECT task_deadline_at - now() FROM allocations WHERE allocation_id = $1", fresh)
    assert 19 * 60 < deadline.total_seconds() <= 20 * 60
    await pool.execute(
        "UPDATE allocations SET task_deadline_at = now() - interval '30 minutes' WHERE allocation_id = ANY($1)",
        [silent, held],
    )

    # Another replica (or a result handler) holds `held`: this sweep skips it instead of waiting or doubling.
    other = await pool.acquire()
    tx = other.transaction()
    await tx.start()
    await other.execute("SELECT 1 FROM allocations WHERE allocation_id = $1 FOR UPDATE", held)
    try:
        # First the silent task is asked again (same task id, a new message), and waited for once more.
        assert await expire_overdue_tasks(lambda: _uow(pool), allocator.settings) == 1
        assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", silent) == "provisioning"
        resent = [
            json.loads(b)
            for (b,) in await pool.fetch("SELECT body FROM outbox WHERE subject = 'gpuaas.node.n1.tasks' ORDER BY id")
        ]
        again = [e for e in resent if e["payload"]["task_id"] == f"prov-{silent}"]
        assert len(again) == 2 and again[0]["event_id"] != again[1]["event_id"]
        # The same task; its deadline is the one the row holds (this test moved it into the past).
        assert {**again[0]["payload"], "deadline": None} == {**again[1]["payload"], "deadline": None}
        await pool.execute(
            "UPDATE allocations SET task_deadline_at = now() - interval '30 minutes' WHERE allocation_id = $1", silent
        )
        assert await expire_overdue_tasks(lambda: _uow(pool), allocator.settings) == 1
    finally:
        await tx.rollback()
        await pool.release(other)

    states = dict(await pool.fetch("SELECT allocation_id, state FROM allocations"))
    assert states == {silent: "failed", held: "provisioning", fresh: "provisioning"}
    row = await pool.fetchrow("SELECT * FROM allocations WHERE allocation_id = $1", silent)
    assert (row["failure_code"], row["awaiting_result"], row["timed_out_task_id"]) == (
        "task_deadline_passed",
        False,
        f"prov-{silent}",
    )
    failed = [
        json.loads(b)["payload"]
        for (b,) in await pool.fetch("SELECT body FROM outbox WHERE subject = 'gpuaas.allocation.event.failed'")
    ]
    assert [(f["allocation_id"], f["reason_code"], f["cleanup_required"]) for f in failed] == [
        (str(silent), "task_deadline_passed", True)
    ]
    timeline = await pool.fetchrow(
        "SELECT state, reason_code, detail FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq DESC", silent
    )
    assert (timeline["state"], timeline["reason_code"]) == ("failed", "task_deadline_passed")

    # The next pass takes the row that was held (asks it again); nothing is timed out twice.
    assert await expire_overdue_tasks(lambda: _uow(pool), allocator.settings) == 1
    assert await expire_overdue_tasks(lambda: _uow(pool), allocator.settings) == 0

    # The host answers after all: recorded on the timeline, nothing applied, no event, no dead letter.
    outbox_before = await pool.fetchval("SELECT count(*) FROM outbox")
    await _send(
        pool,
        allocator.on_task_result,
        "node.task_result",
        m.NodeTaskResult(
            task_id=f"prov-{silent}",
            allocation_id=silent,
            node_id="n1",
            task_type="slice.vm_provision",
            status="succeeded",
        ),
    )
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", silent) == "failed"
    assert await pool.fetchval("SELECT count(*) FROM outbox") == outbox_before
    late = await pool.fetchrow(
        "SELECT state, reason_code, detail FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq DESC", silent
    )
    assert (late["state"], late["reason_code"]) == ("failed", "late_task_result_ignored")
    assert json.loads(late["detail"])["status"] == "succeeded"

    with pytest.raises(PermanentError):
        await _send(
            pool,
            allocator.on_task_result,
            "node.task_result",
            m.NodeTaskResult(
                task_id="prov-never-sent",
                allocation_id=silent,
                node_id="n1",
                task_type="slice.vm_provision",
                status="succeeded",
            ),
        )


async def test_an_overdue_task_asked_again_is_answered_from_the_agents_record(pool) -> None:
    """The agent ran the task and answered, but the allocator's commit of that answer was lost (a database
    crash without synchronous commit, chaos run seed 20261124): the re-asked task is answered again from the
    agent's record and the allocation goes on, instead of failing with its slots blocked."""
    allocator = Allocator(AllocatorSettings())
    async with _uow(pool) as uow:
        await uow.repos.upsert_image(IMAGE)
        await uow.commit()
    alloc = await _provisioning(pool, allocator)
    await pool.execute(
        "UPDATE allocations SET task_deadline_at = now() - interval '30 minutes' WHERE allocation_id = $1", alloc
    )
    assert await expire_overdue_tasks(lambda: _uow(pool), allocator.settings) == 1
    await _send(
        pool,
        allocator.on_task_result,
        "node.task_result",
        m.NodeTaskResult(
            task_id=f"prov-{alloc}",
            allocation_id=alloc,
            node_id="n1",
            task_type="slice.vm_provision",
            status="succeeded",
            readiness=m.Readiness(
                mac="52:54:00:00:00:01",
                expected_ip="127.100.0.10",
                actual_ip="127.100.0.10",
                lease_state="bound",
                ssh_ready=True,
            ),
        ),
    )
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc) == "active"


async def test_a_baremetal_allocation_whose_maas_result_never_came_sends_its_command_again(pool) -> None:
    """The deploy result was consumed but the allocator's commit of it was lost (a database crash without
    synchronous commit, chaos run): the result will not be delivered again, so after `maas_reask_after_s` the
    same deploy (same operation id) is sent again and the gateway answers with its stored result."""
    from gpuaas_allocator.service_layer.deadlines import reask_stalled_maas_commands

    allocator = Allocator(AllocatorSettings(maas_reask_after_s=60))
    host = ActiveImage("ubuntu-host", "host", "h200-sxm", "b" * 64, "/img/host.tgz")
    async with _uow(pool) as uow:
        await uow.repos.upsert_image(host)
        await uow.commit()
    alloc = uuid.uuid4()
    await _send(
        pool,
        allocator.on_requested,
        "allocation.requested",
        m.AllocationRequested(
            allocation_id=alloc,
            tenant_id="t",
            shape="baremetal",
            sku="h200-sxm",
            gpu_count=8,
            image=host.slug,
            ssh_public_keys=["ssh-ed25519 AAAA k@t"],
        ),
    )
    await _send(
        pool,
        allocator.on_placed,
        "placement.placed",
        m.PlacementPlaced(
            allocation_id=alloc, node_id="bm1", claim_mode="node_exclusive", maas_system_id="abc123", fencing_epoch=1
        ),
    )
    assert await reask_stalled_maas_commands(lambda: _uow(pool), allocator.settings) == 0, "not overdue yet"
    await pool.execute(
        "UPDATE allocations SET updated_at = now() - interval '2 minutes' WHERE allocation_id = $1", alloc
    )
    assert await reask_stalled_maas_commands(lambda: _uow(pool), allocator.settings) == 1
    sent = [
        json.loads(b)
        for (b,) in await pool.fetch("SELECT body FROM outbox WHERE subject = 'gpuaas.maas.command.deploy' ORDER BY id")
    ]
    assert len(sent) == 2 and sent[0]["event_id"] != sent[1]["event_id"]
    assert sent[0]["payload"] == sent[1]["payload"]
    assert await reask_stalled_maas_commands(lambda: _uow(pool), allocator.settings) == 0, "the wait restarted"
