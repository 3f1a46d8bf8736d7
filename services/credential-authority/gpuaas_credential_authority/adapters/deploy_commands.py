"""The MAAS stream as the authority reads it: one message by its sequence (`$JS.API.STREAM.MSG.GET.MAAS`, its only
right there), the deploy command a mint request names. Read fresh at each mint: nothing is kept, so replicas of
this process agree without sharing anything."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import nats.js.errors

from ..domain.deploy_commands import StoredMessage

STREAM = "MAAS"


class StreamUnreadable(RuntimeError):
    """The bus did not answer the read (away, or slow): nothing is decided, the caller may ask again."""


class DeployCommands:
    def __init__(self, js: Any) -> None:
        self.js = js

    async def at(self, seq: int) -> StoredMessage | None:
        """The stream's message `seq`, or None where it holds none (never written, deleted or aged out)."""
        try:
            raw = await self.js.get_msg(STREAM, seq)
        except nats.js.errors.NotFoundError:
            return None
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise StreamUnreadable(f"message {seq} of {STREAM}: {type(exc).__name__}") from None
        if raw.subject is None or raw.time is None:
            return None
        return StoredMessage(raw.subject, raw.data or b"", raw.time)
