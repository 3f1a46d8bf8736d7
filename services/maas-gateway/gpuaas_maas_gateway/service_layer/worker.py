"""The poll loop: drives every open operation, one step at a time, through its kind's module.

Each MAAS site has its own client (and API key), concurrency limit and circuit breaker. While a site's
breaker is open its operations wait where they are; they are neither failed nor submitted.

Replicas: any number of workers share the operations table. A worker steps an operation only under its
lease (migration 005): claimed among the due rows with FOR UPDATE SKIP LOCKED, renewed while the step
runs, dropped when it ends; every write of the step is fenced on it. A worker that dies leaves its leases
to run out, and only then does another take its operations over: a `submitting` one becomes unknown and
is resolved by reading the machine, never by calling again blindly. Nothing is done at start-up: a
starting worker cannot tell its predecessor's interrupted calls from a live worker's, the leases can.

A site's circuit breaker and concurrency limit are each replica's own: a replica judges MAAS by the calls
it makes, and N replicas may have up to N x the site's limit in flight (size maas_max_concurrency for it).
Tag syncs, uploads and profile image switches are operations like the others, under the same leases.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gpuaas_common.cancellation import stop_if_cancelled
from gpuaas_common.db import DB_UNAVAILABLE
from gpuaas_common.logging import bound_context, get_logger

from ..adapters.maas_errors import MaasError
from ..adapters.repository import OPEN_STATES, LeaseLost
from . import commission, deploy, release, set_distro_series, sync_tags, upload_image
from .ports import Row
from .shared import BreakerOpen, Operations, Site, Unresolvable, now

log = get_logger(__name__)

STEPS: dict[str, Callable[[Operations, Site, Row], Awaitable[None]]] = {
    "deploy": deploy.step,
    "release": release.step,
    "commission": commission.step,
    "sync_tags": sync_tags.step,
    "upload_image": upload_image.step,
    "set_distro_series": set_distro_series.step,
}


class OperationWorker(Operations):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Claim no more than the sites can work on: a claimed row waiting for a semaphore is one the
        # other replicas cannot have.
        self.capacity = sum(site.limit for site in self.sites.values()) or self.settings.maas_max_concurrency

    async def run(self) -> None:
        pause = min(0.2, self.settings.maas_poll_interval_s)
        backoff = pause
        while True:
            stop_if_cancelled()
            try:
                await self.tick()
                backoff = pause
            except DB_UNAVAILABLE as exc:
                # Postgres restarting or failing over: the claims wait in the database; a worker that died here
                # would take the whole gateway down with it (the chaos run saw 19 such exits).
                backoff = min(backoff * 2, 5.0)
                log.warning("operation_poll_failed", error=repr(exc)[:300], retry_in_s=backoff)
            await asyncio.sleep(backoff)

    async def tick(self) -> None:
        free = self.capacity - len(self._in_flight)
        if free <= 0:
            return
        # Lease statements are single statements on the pool: nothing to roll back should one be cut short.
        claimed = await self.read.operations.claim_due(self.owner, self.lease_s, free, sorted(self._in_flight))
        for row in claimed:
            op_id = row["operation_id"]
            self._in_flight.add(op_id)
            task = asyncio.ensure_future(self._step_claimed(op_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _step_claimed(self, op_id: str) -> None:
        try:
            await self.step(op_id)
        finally:
            self._in_flight.discard(op_id)

    async def step(self, op_id: str) -> None:
        """One step of one operation under its lease (the tick's, or taken here when called directly)."""
        claimed = await self.read.operations.claim(op_id, self.owner, self.lease_s)
        if claimed is None:
            return  # closed, or another worker holds it
        done = asyncio.Event()
        renewing = asyncio.ensure_future(self._renew(op_id, done))
        try:
            await self._step_guarded(op_id, claimed["site"])
        except LeaseLost:
            # Our lease ran out and another worker took the operation over: it is theirs now.
            log.warning("operation_taken_over", operation_id=op_id)
            return
        finally:
            # Stopped between two renewals, never inside one (a cancelled statement would leave its
            # connection to be cleaned up by whoever comes next).
            done.set()
            await renewing
        # Not reached when the step is cancelled (shutdown): a call it may have had in flight can still
        # reach MAAS, so the lease is left to run out before anybody looks at the machine. A release
        # that fails does the same.
        try:
            await self.read.operations.release(op_id, self.owner)
        except DB_UNAVAILABLE as exc:
            log.warning("operation_lease_release_failed", operation_id=op_id, error=repr(exc)[:300])

    async def _renew(self, op_id: str, done: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(done.wait(), timeout=self.lease_s / 4)
                return
            except TimeoutError:
                pass  # the step is still running: time to renew
            try:
                if not await self.read.operations.renew(op_id, self.owner, self.lease_s):
                    # Taken over: the step's next write is refused (LeaseLost) and a call it has not
                    # started yet is never started.
                    log.warning("operation_lease_lost", operation_id=op_id)
                    return
            except DB_UNAVAILABLE as exc:
                # Tried again at the next beat; should the lease run out meanwhile, the fence holds.
                log.warning("operation_lease_renew_failed", operation_id=op_id, error=repr(exc)[:300])

    async def _step_guarded(self, op_id: str, site_name: str) -> None:
        site = self.sites.get(site_name)
        try:
            if site is None:
                await self._step(op_id)
                return
            async with site.semaphore:
                await self._step(op_id)
        except LeaseLost:
            raise
        except BreakerOpen as exc:
            await self.set(
                op_id,
                delay=max(exc.wait_s, self.settings.maas_poll_interval_s),
                last_error="MAAS unreachable: circuit breaker open",
            )
        except Exception as exc:  # noqa: BLE001 - keep the loop alive; the row stays open and is retried
            log.error("operation_step_failed", operation_id=op_id, error=repr(exc))
            delay = self.retry_delay(exc if isinstance(exc, MaasError) else None)
            await self.set(op_id, delay=delay, last_error=repr(exc)[:500])

    async def _step(self, op_id: str) -> None:
        row = await self.read.operations.get(op_id)
        if row is None or row["state"] not in OPEN_STATES:
            return
        ctx = {"operation_id": op_id, "site": row["site"], "kind": row["kind"]}
        if row["allocation_id"] is not None:
            ctx["allocation_id"] = str(row["allocation_id"])
        if row["system_id"] is not None:
            ctx["system_id"] = row["system_id"]
        with bound_context(**ctx):
            if row["deadline_at"] <= now():
                never_sent = row["state"] == "pending" and row["maas_calls"] == 0
                await self.finish(
                    row,
                    "failed",
                    reason_code="maas_unreachable" if never_sent else "unresolved",
                    message="no outcome observed before the deadline",
                )
                return
            site = self.sites.get(row["site"])
            if site is None:
                await self.finish(
                    row, "failed", reason_code="unknown_site", message=f"no MAAS site {row['site']!r} is configured"
                )
                return
            clock = self.clock()
            if not site.breaker.allow(clock):
                raise BreakerOpen(site.breaker.wait_s(clock))
            try:
                await STEPS[row["kind"]](self, site, row)
            except Unresolvable as exc:
                await self.finish(row, "failed", reason_code=exc.reason_code, message=exc.message)
            finally:
                # A step that made no MAAS call must not keep a half-open breaker's one trial slot.
                site.breaker.released()
                site.publish_state()
