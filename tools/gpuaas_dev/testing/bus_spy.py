"""A core-NATS subscriber on `gpuaas.>` that validates every message it sees against the contract.

Tests keep one running for their whole duration and assert at the end that nothing violated the
committed AsyncAPI document; they also use it to wait for events instead of sleeping.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import nats
from nats.aio.client import Client as NatsClient

from gpuaas_common.contract.asyncapi import ContractValidator, ContractViolation, default_validator


class BusSpy:
    def __init__(
        self,
        url: str,
        subject: str = "gpuaas.>",
        validator: ContractValidator | None = None,
        connect: dict[str, Any] | None = None,
    ) -> None:
        """`connect`: nats.connect() options (creds, TLS, inbox) of an identity that may read `subject`."""
        self.url = url
        self.connect = connect
        self.subject = subject
        self.validator = validator or default_validator()
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self.violations: list[str] = []
        self.allowed_invalid: set[str] = set()
        self._changed = asyncio.Event()
        self._nc: NatsClient | None = None

    async def start(self) -> "BusSpy":
        self._nc = await nats.connect(**self.connect) if self.connect else await nats.connect(self.url)
        await self._nc.subscribe(self.subject, cb=self._on_msg)
        await self._nc.flush()
        return self

    async def stop(self) -> None:
        if self._nc:
            await self._nc.drain()

    async def _on_msg(self, msg: Any) -> None:
        if msg.subject.startswith("$JS"):
            return
        try:
            data = self.validator.validate(msg.subject, msg.data)
        except ContractViolation as exc:
            if msg.data.decode(errors="replace") not in self.allowed_invalid:
                self.violations.append(str(exc))
            try:
                data = json.loads(msg.data)
            except ValueError:
                data = {"type": "<not json>", "raw": msg.data.decode(errors="replace")}
            if not isinstance(data, dict):
                data = {"type": "<not an object>", "raw": msg.data.decode(errors="replace")}
        self.messages.append((msg.subject, data))
        self._changed.set()

    def allow_invalid(self, body: bytes | str) -> None:
        """Tests that publish malformed input on purpose exempt exactly those bodies."""
        self.allowed_invalid.add(body.decode() if isinstance(body, bytes) else body)

    def of_type(self, type_: str, **payload_match: Any) -> list[dict[str, Any]]:
        out = []
        for _, data in self.messages:
            if data.get("type") != type_:
                continue
            payload = data.get("payload", {})
            if not isinstance(payload, dict):
                continue
            if all(str(payload.get(k)) == str(v) for k, v in payload_match.items()):
                out.append(data)
        return out

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            result = predicate()
            if result:
                return result
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise TimeoutError(f"timed out waiting for {what}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass

    async def wait_type(self, type_: str, timeout: float = 30.0, **payload_match: Any) -> dict[str, Any]:
        found = await self.wait_for(lambda: self.of_type(type_, **payload_match), timeout, f"{type_} {payload_match}")
        return found[0]
