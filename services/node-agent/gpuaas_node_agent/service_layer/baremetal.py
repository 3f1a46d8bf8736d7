"""A baremetal host's enrolment: announce `node.enrolled` until it is on the stream, then again on a schedule
until the agent's own deadline.

No answer from the allocator reaches a baremetal host: its allocation-bound user may publish only its own
reports and read only its own inbox (identity/permissions.py), and no host durable is provisioned for it. A
PubAck says the stream has the announcement, not that the allocator committed it, and an allocator that lost
an acknowledged commit (Postgres failing over) can only learn of the host again from the host. So the host
repeats with growing pauses; the allocator applies a repeat of an enrolment it has as a no-op, and the
repeats stop at the deadline, by when the allocation is active or has failed with `enrolment_timeout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_before_delay, wait_exponential

from gpuaas_common.logging import get_logger

from ..domain.baremetal import BaremetalIdentity, announcement_id, enrolment, pause_before_repeat

log = get_logger(__name__)

Publish = Callable[..., Awaitable[Any]]


class BaremetalHostAgent:
    def __init__(
        self,
        identity: BaremetalIdentity,
        hostname: str,
        agent_version: str,
        publish: Publish,
        *,
        announce_again_s: tuple[float, ...],
        announce_for_s: float,
        first_retry_max_s: float = 10.0,
        boot_seconds: float | None = None,
    ) -> None:
        self.identity = identity
        self.publish = publish
        self.announce_again_s = announce_again_s
        self.announce_for_s = announce_for_s
        self.first_retry_max_s = first_retry_max_s
        self.event = enrolment(identity, hostname, agent_version, boot_seconds)
        self.enrolled = False

    async def _announce(self, repeat: int) -> None:
        await self.publish(
            "node.enrolled",
            self.event,
            correlation_id=str(self.identity.allocation_id),
            event_id=announcement_id(self.identity, repeat),
            node_id=self.identity.node_id,
        )

    async def run(self) -> None:
        """Returns once the deadline has passed; the host's link stays up for the caller."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.announce_for_s
        fields = {"node_id": self.identity.node_id, "allocation_id": str(self.identity.allocation_id)}
        # The first announcement is what the allocation waits for: a stream not there yet, a server restarting
        # or a timed-out PubAck is tried again soon, not on the repeat schedule.
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(Exception),
                wait=wait_exponential(multiplier=0.2, max=self.first_retry_max_s),
                stop=stop_before_delay(self.announce_for_s),
                reraise=True,
                before_sleep=lambda state: log.warning(
                    "baremetal_enrol_failed", error=str(state.outcome.exception()), **fields
                ),
            ):
                with attempt:
                    await self._announce(0)
        except Exception as exc:
            log.error("baremetal_enrolment_gave_up", error=str(exc), deadline_s=self.announce_for_s, **fields)
            return
        self.enrolled = True
        log.info("baremetal_enrolled", **fields)
        repeat = 0
        while self.announce_again_s:
            pause = pause_before_repeat(self.announce_again_s, repeat + 1)
            if loop.time() + pause > deadline:
                break
            await asyncio.sleep(pause)
            repeat += 1
            try:
                await self._announce(repeat)
                log.info("baremetal_announced_again", repeat=repeat, **fields)
            except Exception as exc:  # the next pause brings the next try
                log.warning("baremetal_announce_failed", repeat=repeat, error=str(exc), **fields)
        log.info("baremetal_announcements_ended", repeats=repeat, **fields)
