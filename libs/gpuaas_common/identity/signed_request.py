"""Requests to the credential authority, signed with the caller's own bus identity.

The authority (`services/credential-authority`) holds the keys that sign; a service that needs a host user
minted or revoked (the MAAS gateway) asks it over HTTPS. The caller proves who it is the way NATS itself makes
a client prove it, so no second secret is handed out: the request carries the caller's user JWT and a signature,
made with that user's nkey seed, over the method, the path, a digest of the body, a timestamp and a nonce. The
authority checks that the JWT was signed by the account's own signing key, names an allowed role, has not
expired and is not revoked, and that the signature verifies against the JWT's subject. A captured request
cannot be sent again (the nonce is remembered for as long as the timestamp is accepted) nor changed (the body's
digest is signed). The creds file the caller signs with is the one it renews like any other (24 h).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from .creds import Creds
from .jwt import JwtError, Key, decode, verify_signature

HEADER = "Authorization"
SCHEME = "Gpuaas-Nkey"
# A request older or newer than this is refused; the nonce cache covers the same window, so within it a replay is
# refused by its nonce and after it by its age. Both clocks are the deployment's (NTP): a minute is generous.
MAX_SKEW_S = 60


class RequestRefused(Exception):
    """A request the authority will not serve; `reason` is a stable code, the message says what was wrong."""

    def __init__(self, reason: str, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def canonical(method: str, path: str, body: bytes, ts: int, nonce: str) -> bytes:
    """What is signed: every part of the request the authority acts on, so none can be swapped."""
    digest = hashlib.sha256(body).hexdigest()
    return f"{method.upper()}\n{path}\n{digest}\n{ts}\n{nonce}".encode()


def sign(creds: Creds, method: str, path: str, body: bytes, *, now: float | None = None) -> str:
    """The `Authorization` header value for one request, signed with `creds`' seed."""
    ts = int(time.time() if now is None else now)
    nonce = secrets.token_urlsafe(18)
    sig = Key.from_seed(creds.seed).sign(canonical(method, path, body, ts, nonce))
    return f"{SCHEME} jwt={creds.jwt},ts={ts},nonce={nonce},sig={_b64(sig)}"


@dataclass(frozen=True)
class Signed:
    jwt: str
    ts: int
    nonce: str
    sig: bytes


def parse(header: str | None) -> Signed:
    if not header:
        raise RequestRefused("unsigned", "no Authorization header: requests are signed with the caller's creds")
    scheme, _, rest = header.partition(" ")
    if scheme != SCHEME:
        raise RequestRefused("unsigned", f"Authorization scheme must be {SCHEME}")
    fields = dict(part.split("=", 1) for part in rest.split(",") if "=" in part)
    try:
        return Signed(fields["jwt"], int(fields["ts"]), fields["nonce"], _unb64(fields["sig"]))
    except (KeyError, ValueError) as exc:
        raise RequestRefused("malformed_signature", f"Authorization lacks or garbles {exc}") from None


class NonceCache:
    """Nonces seen within the accepted window; an older one cannot come back (its timestamp is refused)."""

    def __init__(self, window_s: float = 2 * MAX_SKEW_S, limit: int = 100_000) -> None:
        self.window_s = window_s
        self.limit = limit
        self._seen: OrderedDict[str, float] = OrderedDict()

    def first_use(self, nonce: str, now: float) -> bool:
        while self._seen and (next(iter(self._seen.values())) < now - self.window_s or len(self._seen) > self.limit):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True


@dataclass(frozen=True)
class Trust:
    """Whom the authority believes: users of `account` signed by one of `issuers`, named one of `callers`."""

    account: str
    issuers: frozenset[str]
    callers: frozenset[str]


def verify(
    header: str | None,
    method: str,
    path: str,
    body: bytes,
    *,
    trust: Trust,
    revoked: Mapping[str, int] | Collection[str],
    nonces: NonceCache,
    now: float | None = None,
) -> dict[str, Any]:
    """The caller's JWT claims if the request is theirs, fresh and unaltered; RequestRefused otherwise."""
    now = time.time() if now is None else now
    signed = parse(header)
    try:
        claims = decode(signed.jwt)  # the JWT's own signature, by its issuer
    except JwtError as exc:
        raise RequestRefused("bad_jwt", str(exc)) from None
    if claims.get("iss") not in trust.issuers or claims.get("nats", {}).get("issuer_account") != trust.account:
        raise RequestRefused("foreign_jwt", "the JWT is not signed by this deployment's account")
    if claims.get("nats", {}).get("type") != "user":
        raise RequestRefused("bad_jwt", "not a user JWT")
    exp = claims.get("exp")
    if exp is not None and exp <= now:
        raise RequestRefused("expired", f"the caller's user expired {int(now - exp)} s ago")
    if claims.get("sub") in revoked:
        raise RequestRefused("revoked", "the caller's user is revoked")
    if claims.get("name") not in trust.callers:
        raise RequestRefused("not_allowed", f"role {claims.get('name')!r} may not ask the authority", status=403)
    if abs(now - signed.ts) > MAX_SKEW_S:
        raise RequestRefused("stale", f"request timestamp {int(now - signed.ts)} s away from the authority's clock")
    try:
        verify_signature(str(claims["sub"]), canonical(method, path, body, signed.ts, signed.nonce), signed.sig)
    except JwtError:
        raise RequestRefused("bad_signature", "the request's signature does not verify against the JWT") from None
    if not nonces.first_use(signed.nonce, now):
        raise RequestRefused("replayed", "this request was already served")
    return claims
