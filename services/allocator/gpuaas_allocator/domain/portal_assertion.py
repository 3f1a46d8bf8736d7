"""The portal's word for who opens a terminal: a tenant assertion the portal signs, the allocator checks.

A bearer token that only proves "this is the portal" let whoever held it name any tenant in a header (review 3,
N8). The assertion instead carries the tenant, the person signed in to the portal and an expiry, signed with
HMAC-SHA256 under a secret the portal and the allocator share (GPUAAS_TERMINAL_ASSERTION_SECRET):
`v1.<base64url(JSON claims)>.<base64url(mac)>`. It opens only that tenant's consoles, only until it expires,
and the audit row names the person. Pure: the clock is passed in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from dataclasses import dataclass

VERSION = "v1"
# The portal mints one per console it opens: a minute is ample, and a leaked one is soon worth nothing.
MAX_LIFETIME_S = 300
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


@dataclass(frozen=True)
class TenantAssertion:
    tenant_id: str
    user_id: str
    expires_at: int  # unix seconds


class AssertionRefused(ValueError):
    """Why an assertion opens nothing; the message is the one line the caller is told."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, body: str) -> bytes:
    return hmac.new(secret, f"{VERSION}.{body}".encode(), hashlib.sha256).digest()


def sign(secret: bytes, assertion: TenantAssertion) -> str:
    """What the portal sends as `Authorization: Bearer …` (the tests, and the portal's reference)."""
    claims = {"tenant_id": assertion.tenant_id, "user_id": assertion.user_id, "exp": assertion.expires_at}
    body = _b64(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
    return f"{VERSION}.{body}.{_b64(_mac(secret, body))}"


def verify(secret: bytes, token: str, now: float) -> TenantAssertion:
    """The assertion `token` carries, when the portal signed it and it has not expired; else AssertionRefused.
    The signature is checked before anything in the claims is read."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        raise AssertionRefused("not a portal tenant assertion (v1.<claims>.<signature>)")
    body, given = parts[1], parts[2]
    try:
        mac = _unb64(given)
    except ValueError:
        raise AssertionRefused("the assertion's signature is not base64url") from None
    if not hmac.compare_digest(mac, _mac(secret, body)):
        raise AssertionRefused("the assertion is not signed by the portal")
    try:
        claims = json.loads(_unb64(body))
        tenant, user, exp = claims["tenant_id"], claims["user_id"], claims["exp"]
    except (ValueError, KeyError, TypeError):
        raise AssertionRefused("the assertion's claims are not tenant_id, user_id and exp") from None
    if not (isinstance(tenant, str) and _ID.match(tenant) and isinstance(user, str) and _ID.match(user)):
        raise AssertionRefused("the assertion's tenant_id and user_id must be identifiers")
    if not isinstance(exp, int) or isinstance(exp, bool):
        raise AssertionRefused("the assertion's exp must be unix seconds")
    if exp <= now:
        raise AssertionRefused("the assertion has expired")
    if exp > now + MAX_LIFETIME_S:
        raise AssertionRefused(f"the assertion lives longer than {MAX_LIFETIME_S}s: the portal mints one per console")
    return TenantAssertion(tenant, user, exp)
