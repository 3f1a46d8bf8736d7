"""Errors the simulator answers with, each carrying MAAS's exact status code and body.

Kept apart from the handlers so the pure state machine can raise them without knowing about HTTP.
"""

from __future__ import annotations

import json
from typing import Any


class MaasSimError(Exception):
    """An error MAAS would answer with; `body` is text, or a dict rendered as JSON."""

    status: int = 400

    def __init__(
        self,
        body: str | dict[str, Any],
        *,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        content_type: str | None = None,
    ) -> None:
        super().__init__(body if isinstance(body, str) else json.dumps(body))
        if status is not None:
            self.status = status
        self.body = body
        self.headers = dict(headers or {})
        if content_type is None:
            content_type = "text/plain" if isinstance(body, str) else "application/json"
        self.content_type = content_type

    def render(self) -> bytes:
        if isinstance(self.body, str):
            return self.body.encode("utf-8")
        return json.dumps(self.body).encode("utf-8")


class BadRequest(MaasSimError):
    status = 400


class Unauthorized(MaasSimError):
    """MAAS always names the realm, and OAuth clients rely on it to decide to re-sign."""

    status = 401

    def __init__(self, body: str) -> None:
        super().__init__(body, headers={"WWW-Authenticate": 'OAuth realm="OAuth"'})


class NotFound(MaasSimError):
    status = 404


class NodeStateViolation(MaasSimError):
    status = 409


class NoMachineAvailable(MaasSimError):
    status = 409
