"""Calling the scheduler's admin HTTP API for the user: its URL and bearer token come from the selected stack
(or the options), every mutation carries an Idempotency-Key and the acting user, and each answer the API can
give maps onto the CLI's one exit-code table."""

from __future__ import annotations

import getpass
import json
import re
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .common import (
    EXIT_FAILED,
    EXIT_USAGE,
    fail,
    no_stack,
    not_found,
    pid_alive,
    read_stack_json,
    refused,
    timed_out,
    unreachable,
)

WHAT = "the scheduler admin API"

AdminUrlOpt = Annotated[
    Optional[str],
    typer.Option(
        "--admin-url",
        envvar="GPUAAS_SCHEDULER_ADMIN_URL",
        help="The scheduler admin API. Default: the selected stack's (`gpuaas context show`).",
    ),
]
TokenOpt = Annotated[
    Optional[str],
    typer.Option(
        "--token",
        envvar="GPUAAS_SCHEDULER_ADMIN_TOKEN",
        show_envvar=False,
        help="Its bearer token. Default: the selected stack's secrets.json.",
    ),
]
ApiTimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the API's answer.")]
ReasonOpt = Annotated[str, typer.Option("--reason", help="Why: recorded in the audit log with your name.")]
ActorOpt = Annotated[
    Optional[str],
    typer.Option("--actor", envvar="GPUAAS_ACTOR", help="Who acts, for the audit log. Default: your login name."),
]
IdempotencyOpt = Annotated[
    Optional[str],
    typer.Option(
        "--idempotency-key",
        help="Reuse the key a timed-out attempt printed, so the change is made once. Default: a new one.",
    ),
]


@dataclass(frozen=True)
class Endpoint:
    url: str
    token: str
    timeout: float
    what: str = WHAT  # how errors name the API


def endpoint(admin_url: Optional[str], token: Optional[str], run_dir: Path, timeout: float) -> Endpoint:
    info = read_stack_json(run_dir) or {}
    running = info.get("status") == "ready" and pid_alive(info.get("supervisor_pid"))
    url = admin_url or (info.get("scheduler_admin_url") if running else None)
    if token is None and running:
        token = (read_stack_json_file(Path(info.get("secrets_file") or run_dir / "secrets.json")) or {}).get(
            "scheduler_admin_token"
        )
    if not url or not token:
        raise no_stack(
            "scheduler admin API",
            run_dir,
            "pass --admin-url and --token (or their $GPUAAS_SCHEDULER_ADMIN_* variables)",
        )
    if not url.startswith(("http://", "https://")):
        raise fail(f"[red]bad admin URL {url!r}[/]: expected http://host:port", EXIT_USAGE)
    return Endpoint(url.rstrip("/"), token, timeout)


def read_stack_json_file(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def actor_name(given: Optional[str]) -> str:
    if given:
        return given
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = ""
    # The API takes identifiers only (letters, digits, ._:@-).
    return re.sub(r"[^A-Za-z0-9._:@-]", "-", user).lstrip("._:@-") or "gpuaas-cli"


def quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def call(
    ep: Endpoint,
    method: str,
    path: str,
    *,
    body: Optional[dict[str, Any]] = None,
    query: Optional[dict[str, Any]] = None,
    key: Optional[str] = None,
    missing: Optional[tuple[str, str]] = None,
) -> Any:
    """One request; returns the decoded answer or ends the command with the table's exit code.

    `missing` is (kind, name) to word a 404 as `no KIND NAME`."""
    headers = {"Authorization": f"Bearer {ep.token}", "Accept": "application/json"}
    data = None
    if method != "GET":
        key = key or uuid.uuid4().hex
        headers["Idempotency-Key"] = key
        headers["Content-Type"] = "application/json"
        data = json.dumps(body or {}).encode()
    params = {k: v for k, v in (query or {}).items() if v is not None}
    url = f"{ep.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    retry = f"; retry with --idempotency-key {key} to make the change at most once" if key else ""
    try:
        with urllib.request.urlopen(request, timeout=ep.timeout) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, _error_body(exc)
    except (TimeoutError, socket.timeout):
        raise timed_out(ep.what, ep.timeout, retry) from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (TimeoutError, socket.timeout)):
            raise timed_out(ep.what, ep.timeout, retry) from None
        raise unreachable(ep.what, ep.url, str(exc.reason)) from None
    except (ConnectionError, OSError) as exc:
        raise unreachable(ep.what, ep.url, str(exc) or type(exc).__name__) from None
    code, message = answer.get("code", f"http_{status}"), answer.get("message", "")
    detail = _details(answer.get("details"))
    if status in (401, 403):
        raise refused(ep.what, f"HTTP {status} {code}")
    if status == 404 and missing:
        raise not_found(*missing)
    if status in (400, 422):
        raise fail(f"[red]invalid request[/]: {message}{detail}", EXIT_USAGE)
    raise fail(f"[red]{code}[/]: {message}{detail} (HTTP {status})", EXIT_FAILED)


def _error_body(exc: urllib.error.HTTPError) -> dict[str, Any]:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _details(details: Any) -> str:
    if isinstance(details, dict) and isinstance(details.get("errors"), list):
        parts = [f"{e.get('loc')}: {e.get('msg')}" for e in details["errors"] if isinstance(e, dict)]
        return f" ({'; '.join(parts)})" if parts else ""
    if isinstance(details, dict) and details:
        return f" ({json.dumps(details, default=str, separators=(',', ':'))})"
    return ""
