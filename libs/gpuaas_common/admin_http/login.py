"""Signed tokens a browser carries instead of a bearer token: a short-lived login link and the session it opens.

Both are minted from a secret of the pages' own (the console's login secret), never from a bearer token of the
API: whoever may read the API may not hand out links, and rotating the secret ends every link and session made
from it. The key is derived per purpose: a login token is never accepted as a session cookie, nor the other way.
A token names the rights the person signs in with (`principals.SIGN_IN_AS`: `ops` reads, `ops-admin` also
changes), the person acting (for the audit of what they do), when it expires and a random nonce; nothing in it is
secret, everything in it is signed. A login link opens one
session: the pages' owner records the nonce of each link used until it expires (`Pages.spend_login`), and refuses
it the second time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass
from urllib.parse import quote

from pydantic import SecretStr

from .headers import ACTOR_RE

LOGIN, SESSION = "login", "session"
# A login link is for clicking now, not for keeping.
LOGIN_TTL_S = 600.0
SESSION_TTL_S = 8 * 3600.0
LOGIN_PATH = "/console/login"
# What a login link says when it comes a second time.
USED = "the link was used already: ask for a new one"
NONCE_RE = re.compile(r"^[0-9a-f]{16,64}$")
# The rights a person may sign in to the pages with (principals.RIGHTS says what each allows).
SIGN_IN_AS = ("ops", "ops-admin")


@dataclass(frozen=True)
class Signed:
    principal: str
    actor: str
    expires_at: float
    # Random, one per token minted: what makes a login link single use.
    nonce: str


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _key(secret: SecretStr | str, purpose: str) -> bytes:
    raw = secret.get_secret_value() if isinstance(secret, SecretStr) else secret
    return hmac.new(raw.encode(), b"gpuaas-admin-browser\0" + purpose.encode(), hashlib.sha256).digest()


def mint(
    secret: SecretStr | str, principal: str, actor: str, *, purpose: str, ttl_s: float, now: float | None = None
) -> str:
    """A token of `purpose` for `actor`, naming `principal` (the rights it carries), signed with a key derived from
    `secret` for `purpose`."""
    if not ACTOR_RE.match(actor) or not ACTOR_RE.match(principal):
        raise ValueError("principal and actor must be identifiers (letters, digits, ._:@-)")
    expires = int((time.time() if now is None else now) + ttl_s)
    body = _b64(
        json.dumps(
            {"p": principal, "a": actor, "x": expires, "n": secrets.token_hex(16)}, separators=(",", ":")
        ).encode()
    )
    mac = hmac.new(_key(secret, purpose), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def verify(
    keys: dict[str, SecretStr | str], token: str, *, purpose: str, now: float | None = None
) -> tuple[Signed | None, str]:
    """(the token's content, "") when one of `keys` (principal -> bearer token) signed it for `purpose` and it
    has not expired; otherwise (None, why) with a reason fit to show: nothing about which key was tried."""
    body, _, mac = token.partition(".")
    try:
        fields = json.loads(_unb64(body))
        given = _unb64(mac)
        principal, actor, expires, nonce = fields["p"], fields["a"], fields["x"], fields["n"]
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None, "the link is not one this console made"
    secret = keys.get(principal) if isinstance(principal, str) else None
    expected = hmac.new(_key(secret or "", purpose), body.encode(), hashlib.sha256).digest()
    if secret is None or not hmac.compare_digest(given, expected):
        return None, "the link is not one this console made"
    if not isinstance(actor, str) or not ACTOR_RE.match(actor) or not isinstance(expires, int):
        return None, "the link is not one this console made"
    if not isinstance(nonce, str) or not NONCE_RE.match(nonce):
        return None, "the link is not one this console made"
    if expires <= (time.time() if now is None else now):
        return None, "the link has expired: ask for a new one"
    return Signed(principal, actor, float(expires), nonce), ""


def login_link(base_url: str, secret: SecretStr | str, rights: str, actor: str, ttl_s: float = LOGIN_TTL_S) -> str:
    """The URL that signs `actor` in, with `rights` ("ops" or "ops-admin"), to the pages at `base_url`; `secret` is
    the pages' login secret."""
    if rights not in SIGN_IN_AS:
        raise ValueError(f"a login link signs in with ops or ops-admin rights, not {rights!r}")
    token = mint(secret, rights, actor, purpose=LOGIN, ttl_s=ttl_s)
    return f"{base_url.rstrip('/')}{LOGIN_PATH}?token={quote(token, safe='')}"
