"""The one error shape of every admin API, and what each documented status means."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict

# What every status means when a route lists it; the schema of each is the shared error shape.
STATUS_TEXT = {
    400: "malformed request: body is not JSON, or the Idempotency-Key header is missing or invalid",
    401: "missing or wrong bearer token",
    403: "the token's principal (or the person it acts for) lacks the right this route needs",
    404: "the named resource does not exist",
    409: "refused in the current state, or the Idempotency-Key was used for another request",
    413: "request body over 1 MiB",
    422: "the request does not match its schema or the service's rules",
    500: "unexpected failure (nothing was committed)",
}


class ErrorBody(BaseModel):
    model_config = ConfigDict(title="ErrorBody")
    code: str
    message: str
    details: dict[str, Any]
    request_id: str


class Error(BaseModel):
    """The one error shape of every admin API."""

    model_config = ConfigDict(title="Error")
    error: ErrorBody


def error_response(
    status: int,
    code: str,
    message: str,
    request_id: str,
    details: dict | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    body = {"error": {"code": code, "message": message, "details": details or {}, "request_id": request_id}}
    return web.json_response(body, status=status, headers={**(headers or {}), "X-Request-Id": request_id})
