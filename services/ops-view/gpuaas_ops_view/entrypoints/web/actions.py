"""The console's changes: a form in, one call to the scheduler's admin API out, as the CLI makes it (the body's
actor and reason, the form's Idempotency-Key so a posted-twice form changes once), and the scheduler's answer in
words for the page. The console decides nothing: the scheduler refuses what it refuses, so a field the API
parses (a quota, a waiver's expiry) travels as typed and its refusal is the API's own."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gpuaas_common.admin_http import ACTING, PRINCIPAL, REQUEST_ID
from gpuaas_common.logging import get_logger

from ...adapters.changes import Changes
from ...adapters.scheduler_admin import SchedulerAdmin, SchedulerUnavailable
from ...domain.filters import IDENTIFIER

log = get_logger(__name__)

REASON_MAX = 500
KEY = re.compile(r"^[\x21-\x7e]{1,200}$")
CHECKBOXES = ("maintenance", "force")


@dataclass(frozen=True)
class Outcome:
    """None `error`: done, with the API's answer. Otherwise what to show and the status to show it with."""

    error: str | None = None
    status: int = 200
    body: dict[str, Any] | None = None


async def read_form(request: web.Request, *, reason_required: bool = True) -> tuple[dict[str, Any], str | None]:
    """The form's fields (stripped text, checkboxes as booleans), its reason and idempotency key, or the problem
    with them. `reason_required=False` leaves a missing reason to the API (a waiver's refusal names it)."""
    form = await request.post()
    fields: dict[str, Any] = {
        name: (value == "on" if name in CHECKBOXES else value.strip())
        for name, value in form.items()
        if isinstance(value, str)
    }
    for box in CHECKBOXES:
        fields.setdefault(box, False)
    reason = fields.get("reason", "")
    key = fields.pop("idempotency_key", "") or uuid.uuid4().hex
    fields.update(reason=reason, key=key, node_id=fields.get("node_id", ""))
    if (reason or reason_required) and (not reason or len(reason) > REASON_MAX or not reason.isprintable()):
        return fields, f"reason is required: why (1-{REASON_MAX} printable characters), for the audit"
    if not KEY.match(key):
        return fields, "idempotency_key is not one this page made"
    return fields, None


def node_problem(node_id: str) -> str | None:
    return None if IDENTIFIER.match(node_id) else "node_id must be a node id: letters, digits and ._:-"


def id_problem(field: str, value: str) -> str | None:
    """Ids go into the API's paths: one that is no identifier is refused here rather than sent elsewhere."""
    return None if IDENTIFIER.match(value) else f"{field} must be an id: letters, digits and ._:-"


def words(text: str) -> list[str] | None:
    """A list typed into one field (spaces or commas between); None for an empty field."""
    found = [w for w in re.split(r"[\s,]+", text) if w]
    return found or None


def number_or_text(text: str) -> int | str:
    """An integer as the API takes it, or the text as typed, which the API refuses in its own words."""
    try:
        return int(text)
    except ValueError:
        return text


async def ask(
    request: web.Request,
    scheduler: SchedulerAdmin,
    changes: Changes,
    what: str,
    path: str,
    body: dict[str, Any],
    key: str,
    *,
    method: str = "POST",
) -> Outcome:
    # The person signed in and the rights of their session (the stack let only `write` rights this far).
    actor, rights = request[ACTING], request[PRINCIPAL]
    try:
        answer = await scheduler.act(
            path, body, actor=actor, rights=rights, idempotency_key=key, request_id=request[REQUEST_ID], method=method
        )
    except SchedulerUnavailable as exc:
        log.warning("console_action_failed", action=what, error=str(exc))
        return Outcome(str(exc), 502)
    if answer.error is not None:
        log.info("console_action_refused", action=what, status=answer.status)
        return Outcome(f"the scheduler refused: {answer.error}", answer.status)
    log.info("console_action", action=what, actor=actor, idempotency_key=key)
    # Every open page refreshes: the scheduler's change is not on the streams the models follow.
    changes.announce("admin")
    return Outcome(body=answer.body)
