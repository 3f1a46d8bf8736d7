"""The console's changes: a form in, one call to the scheduler's admin API out, as the CLI makes it (the body's
actor and reason, the form's Idempotency-Key so a posted-twice form changes once), and the scheduler's answer in
words for the page. The console decides nothing: the scheduler refuses what it refuses."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gpuaas_common.admin_http import ACTING, REQUEST_ID
from gpuaas_common.logging import get_logger

from ...adapters.changes import Changes
from ...adapters.scheduler_admin import SchedulerAdmin, SchedulerUnavailable
from ...domain.filters import IDENTIFIER

log = get_logger(__name__)

REASON_MAX = 500
KEY = re.compile(r"^[\x21-\x7e]{1,200}$")


@dataclass(frozen=True)
class Outcome:
    """None `error`: done. Otherwise what to show and the status to show it with."""

    error: str | None = None
    status: int = 200


async def read_form(request: web.Request) -> tuple[dict[str, Any], str | None]:
    """The form's fields every change has (reason, idempotency key) and its checkboxes, or the problem with it."""
    form = await request.post()
    reason = str(form.get("reason", "")).strip()
    key = str(form.get("idempotency_key", "")) or uuid.uuid4().hex
    fields = {
        "reason": reason,
        "key": key,
        "node_id": str(form.get("node_id", "")).strip(),
        "maintenance": form.get("maintenance") == "on",
        "force": form.get("force") == "on",
    }
    if not reason or len(reason) > REASON_MAX or not reason.isprintable():
        return fields, f"reason is required: why (1-{REASON_MAX} printable characters), for the audit"
    if not KEY.match(key):
        return fields, "idempotency_key is not one this page made"
    return fields, None


def node_problem(node_id: str) -> str | None:
    return None if IDENTIFIER.match(node_id) else "node_id must be a node id: letters, digits and ._:-"


async def ask(
    request: web.Request,
    scheduler: SchedulerAdmin,
    changes: Changes,
    what: str,
    path: str,
    body: dict[str, Any],
    key: str,
) -> Outcome:
    actor = request[ACTING]
    try:
        answer = await scheduler.act(path, body, actor=actor, idempotency_key=key, request_id=request[REQUEST_ID])
    except SchedulerUnavailable as exc:
        log.warning("console_action_failed", action=what, error=str(exc))
        return Outcome(str(exc), 502)
    if answer.error is not None:
        log.info("console_action_refused", action=what, status=answer.status)
        return Outcome(f"the scheduler refused: {answer.error}", answer.status)
    log.info("console_action", action=what, actor=actor, idempotency_key=key)
    # Every open page refreshes: the scheduler's change is not on the streams the models follow.
    changes.announce("admin")
    return Outcome()
