"""Jinja2 over the console's templates: autoescaped, and a page's live part rendered alone for the refresh that
its server-sent events ask for (the same template, so the refreshed part cannot differ from a reload's)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import jinja2
from aiohttp import web

from gpuaas_common.contract import AllocationState, SlotStatus

ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("gpuaas_ops_view.entrypoints.web", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
# The header the page's script sends when it asks for the live part only.
LIVE_HEADER = "X-Console-Live"


def _ts(value: datetime | None) -> str:
    if value is None:
        return "—"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


ENV.filters.update(ts=_ts, age=_age, pretty=_pretty)
# The lists the templates test values against, from the contract's vocabulary: a template holds no copy of one.
ENV.globals.update(
    # An allocation past these has nothing left to release (`rejected`: the read model's own, never accepted).
    ENDED_STATES=(AllocationState.RELEASED, AllocationState.FAILED, "rejected", AllocationState.UNSCHEDULABLE),
    # Slot statuses that take a slot out of service until ops act.
    BLOCKED_SLOT_STATUSES=(SlotStatus.CLEANUP_BLOCKED, SlotStatus.DISABLED),
)


def page(request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
    """The whole page, or its `live` block alone when the page's script asks for it."""
    tmpl = ENV.get_template(template)
    if request.headers.get(LIVE_HEADER) == "1":
        body = "".join(tmpl.blocks["live"](tmpl.new_context(context)))
    else:
        body = tmpl.render(context)
    resp = web.Response(status=status, text=body, content_type="text/html", charset="utf-8")
    resp.headers["Cache-Control"] = "no-store"
    return resp
