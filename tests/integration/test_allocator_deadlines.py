"""The allocator's task-deadline sweep on real Postgres: SQL, row locks shared with other replicas, the outbox."""

from __future__ import annotations

import json

import pytest

from gpuaas_allocator.service_layer.commands import provision_task_id, release_task_id
from gpuaas_allocator.service_layer.deadlines import expire_overdue_tasks
from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.bus import PermanentError
from gpuaas_common.contract import messages as m
from gpuaas_common.enrolment import enrolment_proof

from .allocator_db import HOST_IMAGE, allocator_offering, placed_baremetal, pool, provisioning, send, uow  # noqa: F401 (fixture)


async def test_overdue_tasks_fail_once_skip_locked_rows_and_late_answers_are_recorded(pool) -> None:  # noqa: F811
    allocator = await allocator_offering(pool)
    silent, held, fresh = [await provisioning(pool, allocator) for _ in range(3)]
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
        assert await expire_overdue_tasks(lambda: uow(pool), allocator.settings) == 1
        assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", silent) == "provisioning"
        resent = [
            json.loads(b)
            for (b,) in await pool.fetch(
                "SELECT body FROM outbox WHERE subject = 'gpuaas.node.n1.tasks.slice.vm_provision' ORDER BY id"
            )
        ]
        again = [e for e in resent if e["payload"]["task_id"] == provision_task_id(allocator.settings, silent)]
        assert len(again) == 2 and again[0]["event_id"] != again[1]["event_id"]
        # The same task; its deadline is the one the row holds (this test moved it into the past).
        assert {**again[0]["payload"], "deadline": None} == {**again[1]["payload"], "deadline": None}
        await pool.execute(
            "UPDATE allocations SET task_deadline_at = now() - interval '30 minutes' WHERE allocation_id = $1", silent
        )
        assert await expire_overdue_tasks(lambda: uow(pool), allocator.settings) == 1
    finally:
        await tx.rollback()
        await pool.release(other)

    states = dict(await pool.fetch("SELECT allocation_id, state FROM allocations"))
    assert states == {silent: "failed", held: "provisioning", fresh: "provisioning"}
    row = await pool.fetchrow("SELECT * FROM allocations WHERE allocation_id = $1", silent)
    assert (row["failure_code"], row["awaiting_result"], row["timed_out_task_id"]) == (
        "task_deadline_passed",
        False,
        provision_task_id(allocator.settings, silent),
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
    assert await expire_overdue_tasks(lambda: uow(pool), allocator.settings) == 1
    assert await expire_overdue_tasks(lambda: uow(pool), allocator.settings) == 0

    # The host answers after all: recorded on the timeline, nothing applied, no lifecycle event, no dead letter;
    # the VM it built runs for nobody and is sent its teardown.
    outbox_before = await pool.fetchval("SELECT max(id) FROM outbox")
    await send(
        pool,
        allocator.on_task_result,
        "node.task_result",
        m.NodeTaskResult(
            task_id=provision_task_id(allocator.settings, silent),
            allocation_id=silent,
            node_id="n1",
            task_type="slice.vm_provision",
            status="succeeded",
        ),
    )
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", silent) == "failed"
    sent = await pool.fetch("SELECT subject, body FROM outbox WHERE id > $1", outbox_before)
    assert [(r["subject"], json.loads(r["body"])["payload"]["task_id"]) for r in sent] == [
        ("gpuaas.node.n1.tasks.slice.vm_release", release_task_id(allocator.settings, silent))
    ]
    late = await pool.fetchrow(
        "SELECT state, reason_code, detail FROM allocation_timeline WHERE allocation_id = $1 ORDER BY seq DESC", silent
    )
    assert (late["state"], late["reason_code"]) == ("failed", "late_task_result_ignored")
    assert json.loads(late["detail"])["status"] == "succeeded"

    with pytest.raises(PermanentError):
        await send(
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


async def test_an_overdue_task_asked_again_is_answered_from_the_agents_record(pool) -> None:  # noqa: F811
    """The agent ran the task and answered, but the allocator's commit of that answer was lost (a database
    crash without synchronous commit, chaos run seed 20261124): the re-asked task is answered again from the
    agent's record and the allocation goes on, instead of failing with its slots blocked."""
    allocator = await allocator_offering(pool)
    alloc = await provisioning(pool, allocator)
    await pool.execute(
        "UPDATE allocations SET task_deadline_at = now() - interval '30 minutes' WHERE allocation_id = $1", alloc
    )
    assert await expire_overdue_tasks(lambda: uow(pool), allocator.settings) == 1
    await send(
        pool,
        allocator.on_task_result,
        "node.task_result",
        m.NodeTaskResult(
            task_id=provision_task_id(allocator.settings, alloc),
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


async def test_a_baremetal_allocation_whose_maas_result_never_came_sends_its_command_again(pool) -> None:  # noqa: F811
    """The deploy result was consumed but the allocator's commit of it was lost (a database crash without
    synchronous commit, chaos run): the result will not be delivered again, so after `maas_reask_after_s` the
    same deploy (same operation id) is sent again and the gateway answers with its stored result."""
    from gpuaas_allocator.service_layer.deadlines import reask_stalled_maas_commands

    allocator = await allocator_offering(pool, HOST_IMAGE, settings=AllocatorSettings(maas_reask_after_s=60))
    alloc = await placed_baremetal(pool, allocator)
    assert await reask_stalled_maas_commands(lambda: uow(pool), allocator.settings) == 0, "not overdue yet"
    await pool.execute(
        "UPDATE allocations SET updated_at = now() - interval '2 minutes' WHERE allocation_id = $1", alloc
    )
    assert await reask_stalled_maas_commands(lambda: uow(pool), allocator.settings) == 1
    sent = [
        json.loads(b)
        for (b,) in await pool.fetch("SELECT body FROM outbox WHERE subject = 'gpuaas.maas.command.deploy' ORDER BY id")
    ]
    assert len(sent) == 2 and sent[0]["event_id"] != sent[1]["event_id"]
    assert sent[0]["payload"] == sent[1]["payload"]
    assert await reask_stalled_maas_commands(lambda: uow(pool), allocator.settings) == 0, "the wait restarted"


async def test_a_deployed_host_that_never_enrols_fails_its_allocation_at_the_enrolment_deadline(pool) -> None:  # noqa: F811
    """MAAS said deployed, then nothing: the host's first-boot enrolment never came (seen in a chaos run, its
    publish timed out). The allocation does not wait for good: it fails with enrolment_timeout and cleanup
    required; a late enrolment then changes nothing."""
    from gpuaas_allocator.service_layer.deadlines import expire_unenrolled_hosts

    allocator = await allocator_offering(pool, HOST_IMAGE, settings=AllocatorSettings(enrolment_deadline_s=600))
    alloc = await placed_baremetal(pool, allocator)
    await send(
        pool,
        allocator.on_maas_result,
        "maas.deploy_result",
        m.MaasDeployResult(
            operation_id=f"deploy-{alloc}",
            allocation_id=alloc,
            system_id="abc123",
            node_id="bm1",
            resolution="direct",
            attempts=1,
            status="deployed",
        ),
    )
    assert await expire_unenrolled_hosts(lambda: uow(pool), allocator.settings) == 0, "not overdue yet"
    await pool.execute(
        "UPDATE allocations SET updated_at = now() - interval '11 minutes' WHERE allocation_id = $1", alloc
    )
    assert await expire_unenrolled_hosts(lambda: uow(pool), allocator.settings) == 1
    row = await pool.fetchrow("SELECT state, failure_code FROM allocations WHERE allocation_id = $1", alloc)
    assert (row["state"], row["failure_code"]) == ("failed", "enrolment_timeout")
    failed = [
        json.loads(b)["payload"]
        for (b,) in await pool.fetch("SELECT body FROM outbox WHERE subject = 'gpuaas.allocation.event.failed'")
    ]
    assert [(f["reason_code"], f["cleanup_required"]) for f in failed] == [("enrolment_timeout", True)]
    # The machine runs the tenant's image with the tenant's keys: it is released through MAAS at once.
    releases = [
        json.loads(b)["payload"]
        for (b,) in await pool.fetch("SELECT body FROM outbox WHERE subject = 'gpuaas.maas.command.release'")
    ]
    assert [(r["operation_id"], r["system_id"]) for r in releases] == [(f"release-{alloc}", "abc123")]
    assert await expire_unenrolled_hosts(lambda: uow(pool), allocator.settings) == 0, "failed once"
    secret = allocator.settings.enrolment_secret.get_secret_value()
    await send(
        pool,
        allocator.on_enrolled,
        "node.enrolled",
        m.NodeEnrolled(
            node_id="bm1",
            kind="baremetal",
            hostname="bm1",
            agent_version="test",
            maas_system_id="abc123",
            allocation_id=alloc,
            enrolment_proof=enrolment_proof(secret, str(alloc), "abc123"),
        ),
    )
    assert await pool.fetchval("SELECT state FROM allocations WHERE allocation_id = $1", alloc) == "failed"
