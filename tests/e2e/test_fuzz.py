"""Hostile input on every subject our durables read, sent by the identities the server lets publish there,
then an independent check of the streams and the databases, then a normal allocation.

`make test` runs a short form (GPUAAS_FUZZ_COUNT, default 1,500 inputs); `bench/fuzz.py` runs the long one
and prints the figures."""

from __future__ import annotations

import os

import pytest

from gpuaas_dev.testing.fuzz_run import run_fuzz

pytestmark = pytest.mark.e2e


async def test_hostile_input_crashes_nothing_dead_letters_every_bad_message_and_writes_no_partial_rows(
    portal, stack, db
):
    count = int(os.environ.get("GPUAAS_FUZZ_COUNT", "1500"))
    report = await run_fuzz(stack, portal.spy, portal.nc, db, count=count, seed=20261123)

    assert report["sent"] >= count
    assert report["crashed_processes"] == [], report["crashed_processes"]
    assert report["undrained_consumers"] == {}, report["undrained_consumers"]
    assert report["dlq_problems"] == [], report["dlq_problems"][:5]
    # Every input that is malformed, forged or oversize ends in the reading durable's DLQ with a reason.
    assert report["missing_dead_letters"] == {}, report["missing_dead_letters"]
    assert report["database_violations"] == [], report["database_violations"][:10]

    # After ops acknowledge what the hosts claimed about themselves and rediscover them, the stack serves.
    assert set(report["recovery"]["parity_failures_after"].values()) == {0}, report["recovery"]
    alloc = await portal.request("gpu_slice", gpus=1)
    await portal.wait_state(alloc, "active", timeout=120)
    await portal.release(alloc)
    await portal.wait_state(alloc, "released", timeout=120)
