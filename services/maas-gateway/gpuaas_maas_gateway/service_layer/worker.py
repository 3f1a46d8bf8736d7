"""The poll loop: drives every open operation, one step at a time, through its kind's module.

Each MAAS site has its own client (and API key), concurrency limit and circuit breaker. While a site's
breaker is open its operations wait where they are; they are neither failed nor submitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from gpuaas_common.logging import bound_context, get_logger

from ..adapters.maas_errors import MaasError
from ..adapters.repository import OPEN_STATES
from . import commission, deploy, release, set_distro_series, sync_tags, upload_image
from .shared import BreakerOpen, Operations, Site, Unresolvable, now

log = get_logger(__name__)

STEPS: dict[str, Callable[[Operations, Site, asyncpg.Record], Awaitable[None]]] = {
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

    async def run(self) -> None:
        # A restart finds calls that were in flight: their outcome is unknown by definition.
        await self.write(lambda repos: repos.operations.interrupted_calls_are_unknown())
        while True:
            await self.tick()
            await asyncio.sleep(min(0.2, self.settings.maas_poll_interval_s))

    async def tick(self) -> None:
        for row in await self.read.operations.due():
            op_id = row["operation_id"]
            if op_id not in self._in_flight:
                self._in_flight.add(op_id)
                task = asyncio.ensure_future(self._step_guarded(op_id, row["site"]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _step_guarded(self, op_id: str, site_name: str) -> None:
        site = self.sites.get(site_name)
        try:
            if site is None:
                await self.step(op_id)
                return
            async with site.semaphore:
                await self.step(op_id)
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
        finally:
            self._in_flight.discard(op_id)

    async def step(self, op_id: str) -> None:
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
