"""Browser pages on an admin API: mounted under a prefix, signed in by a login link (login.py) that opens a
session cookie, and refused with a page that shows nothing but the refusal."""

from __future__ import annotations

import html
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from pydantic import SecretStr

from .login import SESSION_TTL_S

SESSION_COOKIE = "gpuaas_session"
ACTING = web.RequestKey("acting", str)


@dataclass(frozen=True)
class Pages:
    """`install` adds the pages' routes (all under `prefix`) to the admin API's application; each handler finds
    the signed-in person in `request[ACTING]` and the identity behind them in `request[PRINCIPAL]`. `spend_login`
    records a login link's nonce as used until the link expires (nonce, expiry as a UNIX time) and says whether
    this was its first use: a link opens one session. It must hold across the API's replicas (a row in the
    service's database, whose insert is the check). `login_secret` signs the login links and session cookies: a
    secret of the pages' own, none of the API's bearer tokens; without one no link signs anyone in.
    `request[RIGHTS_KEY]` holds what the signed-in person may do (the pages' changes need `write`: the stack
    refuses them otherwise)."""

    install: Callable[[web.Application], None]
    spend_login: Callable[[str, float], Awaitable[bool]]
    login_secret: SecretStr | None = None
    prefix: str = "/console"
    session_ttl_s: float = SESSION_TTL_S
    # What a refused visitor is told to do to get in (a command, a person to ask).
    how_to_sign_in: str = "ask for a login link"

    def holds(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/")


def plain_page(status: int, title: str, message: str, request_id: str, **headers: str) -> web.Response:
    """A page of one message, for refusals and failures the pages themselves did not render: no data, no script,
    nothing fetched from elsewhere."""
    body = (
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>{t}</title></head><body>"
        "<h1 id=refusal>{t}</h1><p>{m}</p><p><small>request {r}</small></p></body></html>"
    ).format(t=html.escape(title), m=html.escape(message), r=html.escape(request_id))
    resp = web.Response(status=status, text=body, content_type="text/html", charset="utf-8", headers=headers)
    resp.headers["X-Request-Id"] = request_id
    resp.headers["Cache-Control"] = "no-store"
    return resp
