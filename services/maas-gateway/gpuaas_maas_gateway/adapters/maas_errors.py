"""Errors of the MAAS API as the gateway sees them.

`outcome_unknown` is the one fact callers must act on: MAAS commits a state change before it
runs post-commit hooks (the BMC power RPC) and answers, so a timeout, a dropped connection or a
500/503/504 on a mutation may come after the change was made. Such an outcome is resolved by
reading the machine, never by blindly repeating the call. 4xx answers are definite: nothing changed.
"""

from __future__ import annotations

import json
from typing import Any


class MaasError(Exception):
    status: int | None = None

    def __init__(
        self,
        status: int | None,
        body: str,
        retry_after: float | None = None,
        *,
        operation: str = "",
        system_id: str | None = None,
        outcome_unknown: bool = False,
    ) -> None:
        self.status = status
        self.body = body
        self.retry_after = retry_after
        self.operation = operation
        self.system_id = system_id
        self.outcome_unknown = outcome_unknown
        super().__init__(self._describe())

    def _describe(self) -> str:
        where = self.operation + (f" {self.system_id}" if self.system_id else "")
        status = f"HTTP {self.status}" if self.status is not None else "no response"
        body = self.body if len(self.body) <= 300 else self.body[:299] + "…"
        return f"MAAS {where}: {status}: {body}"

    @property
    def json(self) -> Any:
        """The body parsed as JSON (MAAS sends field errors as `{"field": ["message"]}`), or None."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status!r}, operation={self.operation!r}, "
            f"system_id={self.system_id!r}, outcome_unknown={self.outcome_unknown!r}, "
            f"retry_after={self.retry_after!r})"
        )


class MaasBadRequest(MaasError):
    status = 400


class MaasAuthError(MaasError):
    status = 401


class MaasForbidden(MaasError):
    status = 403


class MaasNotFound(MaasError):
    status = 404


class MaasConflict(MaasError):
    """A node state violation, or a DB serialization conflict when `retry_after` is set."""

    status = 409


class MaasServerError(MaasError):
    status = 500


class MaasUnavailable(MaasError):
    status = 503


class MaasGatewayTimeout(MaasError):
    status = 504


class MaasNoResponse(MaasError):
    """The client timed out or the connection dropped before an answer arrived."""

    status = None


class MaasUnreachable(MaasNoResponse):
    """No connection could be made: the request never left, so nothing can have changed."""


# 4xx answers prove nothing was changed; the rest may follow a committed change.
_DEFINITE: dict[int, type[MaasError]] = {
    400: MaasBadRequest,
    401: MaasAuthError,
    403: MaasForbidden,
    404: MaasNotFound,
    409: MaasConflict,
}
_UNKNOWN: dict[int, type[MaasError]] = {
    500: MaasServerError,
    503: MaasUnavailable,
    504: MaasGatewayTimeout,
}


def error_for_status(
    status: int,
    body: str,
    retry_after: float | None,
    *,
    operation: str,
    system_id: str | None,
    mutation: bool,
) -> MaasError:
    if status in _DEFINITE:
        cls = _DEFINITE[status]
        unknown = False
    elif status in _UNKNOWN:
        cls, unknown = _UNKNOWN[status], mutation
    elif status >= 500:
        # 502 and friends come from a proxy that may have forwarded the request.
        cls, unknown = MaasServerError, mutation
    else:
        cls, unknown = MaasError, False
    return cls(
        status,
        body,
        retry_after,
        operation=operation,
        system_id=system_id,
        outcome_unknown=unknown,
    )
