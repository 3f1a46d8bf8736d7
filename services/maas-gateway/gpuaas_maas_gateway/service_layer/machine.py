"""Submit and observe for the operations that change one machine (deploy, release, commission).

Before each MAAS mutation the row is committed as `submitting` (with a fresh lease, longer than the
call's timeout): a crash during the call leaves evidence, and the worker that takes the operation over
once that lease has run out treats it as unknown and observes instead of calling again. Only one operation
per machine may be submitting or unknown at a time, and the database enforces it (migration 004), so two
workers that both saw the machine free cannot both submit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpuaas_common.logging import get_logger

from ..adapters.maas_errors import MaasConflict, MaasError, MaasUnreachable
from ..domain.operations import Decision, decide, decide_commission, release_verdict
from . import slice_preflight
from .metrics import MAAS_CALLS, RESUBMITS, UNKNOWN_OUTCOMES, UNKNOWN_RESOLUTION
from .ports import Row
from .shared import Operations, Site, as_dict, now, release_erase_mode

log = get_logger(__name__)

# Builds the MAAS call for a pending operation; None means "not now, look again later".
Prepare = Callable[[Operations, Site, Row], Awaitable[Callable[[], Awaitable[Any]] | None]]


def machine_step(prepare: Prepare) -> Callable[[Operations, Site, Row], Awaitable[None]]:
    async def step(ops: Operations, site: Site, row: Row) -> None:
        if row["state"] == "pending":
            await submit(ops, site, row, prepare)
        else:
            await observe(ops, site, row)

    return step


async def submit(ops: Operations, site: Site, row: Row, prepare: Prepare) -> None:
    op_id, kind = row["operation_id"], row["kind"]
    # Another operation on this machine whose outcome is not known yet: submitting now could double a
    # mutation MAAS may already have taken. This read only spares work; the index below decides.
    if await ops.read.operations.machine_busy(row["site"], row["system_id"], op_id):
        log.info("maas_submit_deferred_machine_busy")
        await ops.set(op_id, delay=ops.settings.maas_poll_interval_s)
        return
    call = await prepare(ops, site, row)
    if call is None:
        await ops.set(op_id, delay=ops.settings.maas_poll_interval_s)
        return
    # Only this conditional update may start a call: a second worker, or a second operation on the
    # machine, loses here.
    started = await ops.write(lambda repos: repos.operations.start_submit(op_id))
    if started == "machine_busy":
        log.info("maas_submit_deferred_machine_busy")
        await ops.set(op_id, delay=ops.settings.maas_poll_interval_s)
        return
    if started != "started":
        return
    MAAS_CALLS.labels(kind).inc()
    try:
        machine = await ops.maas(site, call)
    except MaasUnreachable as exc:
        # Nothing reached MAAS: still pending, and the breaker decides when to try again.
        await ops.set(op_id, state="pending", last_error=str(exc)[:500], delay=ops.settings.maas_poll_interval_s)
        return
    except MaasError as exc:
        if exc.outcome_unknown:
            UNKNOWN_OUTCOMES.labels(kind).inc()
            log.warning("maas_outcome_unknown", error=str(exc), status=exc.status)
            await ops.set(
                op_id,
                state="unknown",
                unknown_since=now(),
                resolution="polled",
                last_error=str(exc)[:500],
                delay=ops.retry_delay(exc),
            )
        elif isinstance(exc, MaasConflict) and exc.retry_after is not None:
            # A serialization conflict was rolled back: send again after the advised wait.
            await ops.set(op_id, state="pending", last_error=str(exc)[:500], delay=ops.retry_delay(exc))
        elif kind == "deploy" and isinstance(exc, MaasConflict) and await _deployed_by_us(ops, site, row):
            # An earlier submit of ours did land after all (MAAS answers a repeat with 409).
            log.warning("maas_deploy_conflict_is_ours")
            await ops.set(
                op_id,
                state="accepted",
                resolution="polled",
                last_error=str(exc)[:500],
                delay=ops.settings.maas_poll_interval_s,
            )
        else:
            await ops.finish(row, "failed", reason_code=f"maas_http_{exc.status}", message=exc.body[:500])
        return
    log.info("maas_submitted", status=machine.status_name)
    await ops.set(op_id, state="accepted", last_status=machine.status_name, delay=ops.settings.maas_poll_interval_s)


def _login(ops: Operations, row: Row, machine: Any) -> dict[str, Any]:
    """Where the tenant logs in to a Deployed machine: MAAS's addresses for it, as the profile's image's default
    user (whom the deploy's user-data gave the tenant's keys)."""
    profile = ops.settings.site_profiles.get(row["profile"] or "")
    return {
        "ip_addresses": list(machine.ip_addresses),
        "login_user": profile.login_user if profile is not None else None,
    }


async def _deployed_by_us(ops: Operations, site: Site, row: Row) -> bool:
    mine = await ops.maas(
        site, lambda: site.client.list_machines(id=row["system_id"], agent_name=str(row["allocation_id"]))
    )
    return any(mm.status_name in ("Deploying", "Deployed") for mm in mine)


async def observe(ops: Operations, site: Site, row: Row) -> None:
    op_id, kind = row["operation_id"], row["kind"]
    try:
        machine = await ops.maas(site, lambda: site.client.read_machine(row["system_id"]))
    except MaasError as exc:
        await ops.set(op_id, last_error=str(exc)[:500], delay=ops.retry_delay(exc))
        return
    untouched_for = (now() - row["unknown_since"]).total_seconds() if row["unknown_since"] else None
    grace = ops.settings.maas_grace_s
    if kind == "commission":
        decision = decide_commission(
            row["state"],
            machine.status_name,
            machine.raw.get("current_commissioning_result_id"),
            (row["progress"] and as_dict(row["progress"]).get("baseline_result_id")),
            untouched_for,
            grace,
        )
    else:
        decision = decide(kind, row["state"], machine.status_name, untouched_for, grace)
    if row["state"] == "unknown" and decision is not Decision.WAIT:
        UNKNOWN_RESOLUTION.labels(kind, decision.value).observe(untouched_for or 0.0)
        log.info("unknown_resolved", decision=decision.value, status=machine.status_name)
    extra: tuple[tuple[str, Any, str], ...] = ()
    if kind == "commission" and decision in (Decision.SUCCEEDED, Decision.FAILED):
        # A finished run (passed or failed: a failing preflight script fails commissioning) is judged
        # by its preflight output, published with the result in the same unit of work.
        try:
            report = await slice_preflight.fetch(ops, site, row, machine)
        except MaasError as exc:
            await ops.set(op_id, last_error=str(exc)[:500], delay=ops.retry_delay(exc))
            return
        log.info("slice_preflight_judged", status=report.status, reasons=len(report.reasons))
        extra = (("node.slice_preflight_reported", report, "slice_preflight"),)
    if kind == "release" and decision in (Decision.SUCCEEDED, Decision.FAILED):
        await _finish_release(ops, site, row, machine)
    elif decision is Decision.SUCCEEDED:
        await ops.finish(
            row,
            "succeeded",
            status=machine.status_name,
            message=machine.status_message,
            result=_login(ops, row, machine) if kind == "deploy" else None,
            extra_events=extra,
        )
    elif decision is Decision.FAILED:
        await ops.finish(
            row,
            "failed",
            status=machine.status_name,
            reason_code="maas_failed",
            message=machine.status_message or f"machine is {machine.status_name}",
            extra_events=extra,
        )
    elif decision is Decision.RESUBMIT:
        RESUBMITS.labels(kind).inc()
        log.warning("unknown_not_accepted_resubmitting", status=machine.status_name)
        await ops.write(lambda repos: repos.operations.back_to_pending(op_id, machine.status_name))
    elif decision is Decision.ACCEPTED:
        await ops.set(op_id, state="accepted", last_status=machine.status_name, delay=ops.settings.maas_poll_interval_s)
    else:
        await ops.set(op_id, last_status=machine.status_name, delay=ops.settings.maas_poll_interval_s)


async def _finish_release(ops: Operations, site: Site, row: Row, machine: Any) -> None:
    """A release ends with its erase read back: the wipe-disks result set MAAS started after the submit
    (domain/operations.py `release_verdict`)."""
    op_id = row["operation_id"]
    try:
        sets = await ops.maas(
            site,
            lambda: site.client.list_results(row["system_id"], result_type="release", include_output=False),
        )
    except MaasError as exc:
        await ops.set(op_id, last_error=str(exc)[:500], delay=ops.retry_delay(exc))
        return
    baseline = int(as_dict(row["progress"]).get("erase_baseline_set_id") or 0)
    newer = [s for s in sets if int(s.get("id") or 0) > baseline]
    erase_set = max(newer, key=lambda s: int(s.get("id") or 0)) if newer else None
    mode = release_erase_mode(row)
    verdict = release_verdict(machine.status_name, erase_set.get("status_name") if erase_set else None)
    if verdict is None:
        await ops.set(op_id, last_status=machine.status_name, delay=ops.settings.maas_poll_interval_s)
        return
    log.info(
        "maas_release_judged",
        erase_mode=mode,
        erase_outcome=verdict.erase_outcome,
        status=machine.status_name,
        result_set_id=erase_set.get("id") if erase_set else None,
    )
    await ops.finish(
        row,
        "succeeded" if verdict.released else "failed",
        status=machine.status_name,
        reason_code=verdict.reason_code,
        message=machine.status_message or verdict.message,
        result={"erase_mode": mode, "erase_outcome": verdict.erase_outcome},
    )
