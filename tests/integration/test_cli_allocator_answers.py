"""The `gpuaas` CLI against a real allocator process over a real nats-server and Postgres: a release the
allocator cannot act on is answered on the bus at once (allocation.release_rejected) and the CLI exits with
the reason instead of waiting out its timeout; `allocations list|show` read what the allocator owns through
allocation.query (request/reply). Every message on `gpuaas.>` and every query answer is checked against
the committed contract."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import nats
import pytest

from gpuaas_allocator.adapters.repository import AllocationRepository
from gpuaas_allocator.domain.model import ActiveImage
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.db import create_pool
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.waiting import service_ready

BIN = Path(sys.executable).parent
SLICE = ActiveImage("ubuntu-24.04-h200-slice", "slice", "h200-sxm-slice", "c" * 64, "/img/slice.raw")
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGNsaS10ZXN0 cli@test"


@pytest.fixture
async def allocator(nats_server, fresh_db, tmp_path) -> AsyncIterator[str]:
    """A real `gpuaas-allocator` process, ready (it knows an active image); yields the NATS URL."""
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator", min_size=1, max_size=1)
    async with UnitOfWork(pool, "allocator", "allocator", AllocationRepository) as uow:
        await uow.repos.upsert_image(SLICE)
        await uow.commit()
    await pool.close()
    ready = tmp_path / "allocator.ready"
    env = {
        **os.environ,
        "GPUAAS_NATS_URL": nats_server.url,
        "GPUAAS_DATABASE_URL": fresh_db,
        "GPUAAS_READY_FILE": str(ready),
        "GPUAAS_HEALTH_PORT": "0",
        "GPUAAS_LOG_LEVEL": "INFO",
    }
    env.pop("GPUAAS_NATS_CREDS", None)
    log = (tmp_path / "allocator.log").open("wb")
    proc = await asyncio.create_subprocess_exec(str(BIN / "gpuaas-allocator"), env=env, stdout=log, stderr=log)
    try:
        await service_ready(ready, proc, tmp_path / "allocator.log")
        yield nats_server.url
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
        log.close()


@pytest.fixture
async def spy(allocator) -> AsyncIterator[BusSpy]:
    s = await BusSpy(allocator).start()
    yield s
    await s.stop()
    assert s.violations == [], s.violations[:5]


async def gpuaas(url: str, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    # Only the URL comes from the command line; the bus here is a plaintext test server, named as such.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_NATS")}
    env["GPUAAS_NATS_INSECURE_DEV"] = "true"
    return await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "gpuaas"), *argv, "--nats-url", url, "--run-dir", str(tmp_path / "no-stack")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


async def allocate(url: str, tmp_path: Path, spy: BusSpy, *, tenant: str, gpus: int) -> uuid.UUID:
    """A slice request through the CLI, once the allocator has accepted it (no scheduler here: it stays accepted)."""
    alloc = uuid.uuid4()
    res = await gpuaas(
        url, tmp_path, "allocate", "--shape", "gpu_slice", "--gpus", str(gpus), "--tenant", tenant,
        "--ssh-key", KEY, "--allocation-id", str(alloc),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    await spy.wait_type("allocation.accepted", allocation_id=alloc)
    return alloc


async def test_release_answers_and_allocation_reads_across_the_bus(allocator, spy, tmp_path) -> None:
    url = allocator

    # Unknown: the allocator says so on the bus and the CLI stops at once, far inside its 60 s timeout.
    unknown = uuid.uuid4()
    t0 = time.monotonic()
    res = await gpuaas(url, tmp_path, "release", str(unknown), "--wait", "--timeout", "60")
    assert res.returncode == 1, res.stderr
    assert time.monotonic() - t0 < 30
    assert "release rejected: unknown_allocation" in res.stderr and "timed out" not in res.stderr
    answer = await spy.wait_type("allocation.release_rejected", allocation_id=unknown)
    assert (answer["payload"]["reason_code"], answer["payload"]["state"]) == ("unknown_allocation", None)

    # A real allocation (no scheduler here, so it waits in `accepted`), found by list and show.
    alloc = await allocate(url, tmp_path, spy, tenant="cli-t1", gpus=2)
    listed = await gpuaas(url, tmp_path, "allocations", "list", "--tenant", "cli-t1", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["allocations"]
    assert [(r["allocation_id"], r["state"], r["gpu_count"]) for r in rows] == [(str(alloc), "accepted", 2)]
    table = await gpuaas(url, tmp_path, "allocations", "list", "--state", "accepted")
    assert table.returncode == 0 and str(alloc) in table.stdout and all(len(x) < 80 for x in table.stdout.splitlines())
    other = await gpuaas(url, tmp_path, "allocations", "list", "--tenant", "cli-t1", "--state", "active", "--json")
    assert json.loads(other.stdout)["allocations"] == [], "every filter given must match"

    # Release: accepted -> releasing is the answer; a second request says a release is under way.
    res = await gpuaas(url, tmp_path, "release", str(alloc))
    assert res.returncode == 0 and "releasing" in res.stderr, res.stderr
    res = await gpuaas(url, tmp_path, "release", str(alloc))
    assert res.returncode == 0 and "already_releasing" in res.stderr, res.stderr

    # The scheduler's "no room" for an allocation already releasing frees it: released, never placed.
    await _publish(url, "placement.unschedulable", m.PlacementUnschedulable(
        allocation_id=alloc, reason_code="no_capacity", reason="test", free_gpus=0, requested_gpus=2,
    ))  # fmt: skip
    await spy.wait_type("allocation.released", allocation_id=alloc)
    res = await gpuaas(url, tmp_path, "release", str(alloc), "--wait", "--json", "--timeout", "60")
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout)
    assert (out["outcome"], out["state"], out["reason_code"], out["ok"]) == (
        "release_rejected",
        "released",
        "already_released",
        False,
    )

    shown = await gpuaas(url, tmp_path, "allocations", "show", str(alloc), "--json")
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    assert detail["state"] == "released" and detail["tenant_id"] == "cli-t1"
    assert [t["state"] for t in detail["timeline"]] == ["requested", "accepted", "releasing", "released"]
    human = await gpuaas(url, tmp_path, "allocations", "show", str(alloc))
    assert human.returncode == 0 and "released" in human.stdout and human.stderr == ""
    missing = await gpuaas(url, tmp_path, "allocations", "show", str(unknown))
    assert missing.returncode == 1 and f"no allocation {unknown}" in missing.stderr


async def test_the_query_answer_is_a_contract_message_and_a_broken_query_is_answered_invalid(allocator) -> None:
    validator = default_validator()
    nc = await nats.connect(allocator)
    try:
        subject = spec_for("allocation.query").subject()
        good = Envelope.wrap("allocation.query", {"state": "active"}, producer="test", correlation_id="q1")
        reply = await nc.request(subject, good.model_dump_json().encode(), timeout=10)
        data = validator.validate(reply.subject, reply.data)
        assert data["type"] == "allocation.query_result" and data["correlation_id"] == "q1"
        assert data["causation_id"] == good.event_id and data["payload"]["status"] == "found"

        broken = Envelope.wrap("allocation.query", {"limit": 0}, producer="test", correlation_id="q2")
        reply = await nc.request(subject, broken.model_dump_json().encode(), timeout=10)
        data = validator.validate(reply.subject, reply.data)
        assert data["payload"]["status"] == "invalid" and "limit" in data["payload"]["reason"]
    finally:
        await nc.drain()


async def test_the_scheduler_audit_reads_a_batch_of_allocations_by_id(allocator, spy, tmp_path) -> None:
    """The scheduler's claim audit asks with a list of ids: the ones the allocator knows come back with their
    state, an id it never accepted is simply absent, and a question naming ids both ways is refused."""
    from gpuaas_scheduler.adapters.allocator_client import AllocatorClient

    known, never = await allocate(allocator, tmp_path, spy, tenant="audit-t1", gpus=1), uuid.uuid4()
    nc = await nats.connect(allocator)
    try:
        states = await AllocatorClient(nc, timeout_s=10).states([known, never])
        assert states is not None and list(states) == [known]
        assert (states[known].state, states[known].tenant_id) == ("accepted", "audit-t1")

        both = Envelope.wrap(
            "allocation.query",
            {"allocation_id": str(known), "allocation_ids": [str(known)]},
            producer="test",
            correlation_id="q3",
        )
        reply = await nc.request(spec_for("allocation.query").subject(), both.model_dump_json().encode(), timeout=10)
        data = default_validator().validate(reply.subject, reply.data)
        assert data["payload"]["status"] == "invalid" and "not both" in data["payload"]["reason"]
    finally:
        await nc.drain()


async def _publish(url: str, type_: str, payload: m.Payload) -> None:
    nc = await nats.connect(url)
    try:
        env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="t")
        await nc.jetstream().publish(spec_for(type_).subject(), env.model_dump_json().encode())
    finally:
        await nc.drain()
