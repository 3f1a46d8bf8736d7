"""A release's MAAS erase, through the gateway's real worker against the simulator and a real Postgres: MAAS is
asked the erase the command names (read back from the simulator's record of the call), and the release is judged
by MAAS's own read-back of the erase (its wipe-disks release result), not by the machine looking Ready."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from gpuaas_common.bus_parsing import parse_message
from gpuaas_dev.maas_sim import Fault, state_of, system_id_for

from .test_maas_gateway_worker import Gateway, pool, settings_for, start_sim, url  # noqa: F401 (fixture)

MACHINES = [{"hostname": "bm-01"}, {"hostname": "bm-02", "secure_erase": False}]
SECURE, NO_SECURE = system_id_for("bm-01"), system_id_for("bm-02")


async def _deployed(gw: Gateway, sid: str, op: str) -> None:
    assert (await gw.finished(await gw.deploy(sid, op)))["state"] == "succeeded"


def _asked(sim: Any, sid: str) -> dict[str, Any]:
    last = sim.machines[sid].last_release
    return {k: last[k] for k in ("erase", "secure_erase", "quick_erase", "erase_mode")}


async def _result(gw: Gateway, op: str) -> dict[str, Any]:
    """The operation's one result as the relay would publish it, validated against the contract."""
    rows = await gw.pool.fetch("SELECT subject, body FROM outbox WHERE subject LIKE 'gpuaas.maas.result.%'")
    found = [p for p in (parse_message(r["subject"], bytes(r["body"]))[1] for r in rows) if p.operation_id == op]
    assert len(found) == 1, found
    return found[0].model_dump(mode="json")


# A region whose global settings erase quickly (and securely) by default: a flag the gateway left out would be
# taken from them, so a full erase would run quick and still report Passed.
QUICK_BY_DEFAULT = {"disk_erase_with_quick_erase": True, "disk_erase_with_secure_erase": True}


@pytest.mark.parametrize("region", [{}, QUICK_BY_DEFAULT], ids=["fresh-region", "quick-by-default-region"])
@pytest.mark.parametrize(
    "sid, mode, asked, ran",
    [
        (SECURE, "secure", {"erase": True, "secure_erase": True, "quick_erase": False}, "secure"),
        # A drive without secure erase: MAAS falls back to the full overwrite, as quick_erase is false.
        (NO_SECURE, "secure", {"erase": True, "secure_erase": True, "quick_erase": False}, "full"),
        (SECURE, "full", {"erase": True, "secure_erase": False, "quick_erase": False}, "full"),
        # An older allocator's command names no erase: the full overwrite.
        (SECURE, None, {"erase": True, "secure_erase": False, "quick_erase": False}, "full"),
    ],
)
async def test_a_release_asks_maas_the_commands_erase_and_is_released_once_the_erase_passed(
    pool: asyncpg.Pool,  # noqa: F811
    sid: str,
    mode: str | None,
    asked: dict[str, bool],
    ran: str,
    region: dict[str, bool],
) -> None:
    runner, port = await start_sim(MACHINES, disk_erasing=0.2)
    sim = state_of(runner)
    sim.config.erase_settings.update(region)
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            await _deployed(gw, sid, "dep")
            row = await gw.finished(await gw.release(sid, "rel", erase_mode=mode))
            assert row["state"] == "succeeded", row
            assert _asked(sim, sid) == {**asked, "erase_mode": ran}
            payload = await _result(gw, "rel")
            assert (payload["status"], payload["erase_mode"], payload["erase_outcome"]) == (
                "released",
                mode or "full",
                "erased",
            )
    finally:
        await runner.cleanup()


async def test_a_failed_erase_is_a_failed_release_with_its_own_reason(pool: asyncpg.Pool) -> None:  # noqa: F811
    runner, port = await start_sim(MACHINES)
    sim = state_of(runner)
    sim.faults.add(Fault("failed_disk_erasing", op="release", system_id=SECURE, count=1))
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            await _deployed(gw, SECURE, "dep")
            row = await gw.finished(await gw.release(SECURE, "rel", erase_mode="secure"))
            assert (row["state"], row["reason_code"]) == ("failed", "disk_erase_failed")
            payload = await _result(gw, "rel")
            assert (payload["status"], payload["maas_status_name"], payload["reason_code"]) == (
                "failed",
                "Failed disk erasing",
                "disk_erase_failed",
            )
            assert (payload["erase_mode"], payload["erase_outcome"]) == ("secure", "failed")
            assert payload["status_message"] == "Failed to erase disks: wipe-disks exited 1"
            assert sim.machines[SECURE].status.label == "Failed disk erasing"
    finally:
        await runner.cleanup()


async def test_an_erase_that_ended_while_the_answer_was_lost_is_read_back_not_guessed(
    pool: asyncpg.Pool,  # noqa: F811
) -> None:
    # The answer is lost after MAAS committed, and the erase is over before the gateway looks again: the machine is
    # Ready and no poll saw Disk erasing. MAAS's wipe-disks result proves the erase; nothing is sent twice.
    runner, port = await start_sim(MACHINES, disk_erasing=0.01, releasing=0.01)
    sim = state_of(runner)
    sim.faults.add(Fault("lost_after_commit", op="release", mode="close", count=1))
    try:
        async with Gateway(pool, settings_for(url(port), maas_poll_interval_s=0.3)) as gw:
            await _deployed(gw, SECURE, "dep")
            row = await gw.finished(await gw.release(SECURE, "rel", erase_mode="full"))
            assert (row["state"], row["resolution"], row["maas_calls"]) == ("succeeded", "polled", 1)
            assert sim.call_count("release", SECURE) == 1
            payload = await _result(gw, "rel")
            assert (payload["erase_mode"], payload["erase_outcome"]) == ("full", "erased")
    finally:
        await runner.cleanup()


async def test_a_release_maas_took_without_erasing_is_not_a_release(pool: asyncpg.Pool) -> None:  # noqa: F811
    # The machine is Ready already (a release MAAS answers as a no-op): MAAS ran no erase for this release, so
    # nothing shows the disks were erased and the release fails as unconfirmed.
    runner, port = await start_sim(MACHINES)
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            row = await gw.finished(await gw.release(SECURE, "rel", erase_mode="secure"))
            assert (row["state"], row["reason_code"]) == ("failed", "disk_erase_unconfirmed")
            payload = await _result(gw, "rel")
            assert (payload["status"], payload["erase_outcome"]) == ("failed", "unconfirmed")
    finally:
        await runner.cleanup()


async def test_a_release_waits_for_its_erase_as_long_as_its_own_deadline_says(pool: asyncpg.Pool) -> None:  # noqa: F811
    """A full overwrite takes hours: a release's deadline is its own, a deploy's the operations' one."""
    runner, port = await start_sim(MACHINES, disk_erasing=0.2)
    try:
        settings = settings_for(url(port), maas_deadline_s=30.0, maas_release_deadline_s=7200.0)
        async with Gateway(pool, settings) as gw:
            await _deployed(gw, SECURE, "dep")
            await gw.release(SECURE, "rel", erase_mode="secure")
            rows = await pool.fetch(
                "SELECT operation_id, EXTRACT(EPOCH FROM deadline_at - created_at) AS s FROM maas_operations "
                "WHERE operation_id IN ('dep', 'rel')"
            )
            allowed = {r["operation_id"]: float(r["s"]) for r in rows}
            assert allowed["dep"] == pytest.approx(30.0, abs=5) and allowed["rel"] == pytest.approx(7200.0, abs=5)
    finally:
        await runner.cleanup()
