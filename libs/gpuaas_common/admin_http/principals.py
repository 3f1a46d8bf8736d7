"""Who may do what on an admin API: each bearer token names a principal, each principal has named rights, and the
API that owns an action checks them (a route needs `read`, `write` or `usage`; a page's change needs `write`).

- `ops`: reads (the ops API, the console's pages, the usage records).
- `ops-admin`: reads and changes (the scheduler's admin API; a console session signed in with these rights).
- `billing`: the usage export and nothing else.
- `ops-console`: the console's own identity at the scheduler. By itself it reads; a change it sends carries a
  signed assertion of the signed-in person (`headers.PERSON_HEADER`) and is done with that person's rights, under that
  person's name in the audit. The assertion is an HMAC keyed from the console's own token and bound to the one
  request (method, path, body, Idempotency-Key), so it is good for nothing else, and it expires within a minute.
- `admin`: a service's single full token where it has no others yet (the image pipeline).

A name typed by the caller (`X-Actor`, a body's `actor`) is never who the audit names: that is the principal, or
the person its assertion names.
"""

from __future__ import annotations

import hashlib
from urllib.parse import unquote

from pydantic import SecretStr

from .login import SIGN_IN_AS, mint, verify

READ, WRITE, USAGE = "read", "write", "usage"
RIGHTS: dict[str, frozenset[str]] = {
    "ops": frozenset({READ, USAGE}),
    "ops-admin": frozenset({READ, WRITE, USAGE}),
    "billing": frozenset({USAGE}),
    "ops-console": frozenset({READ}),
    "admin": frozenset({READ, WRITE, USAGE}),
}
# Principals that act for a signed-in person (their assertion travels in PERSON_HEADER).
DELEGATES = frozenset({"ops-console"})
ASSERTION_TTL_S = 60.0


def rights_of(principal: str) -> frozenset[str]:
    return RIGHTS.get(principal, frozenset())


def _purpose(method: str, path: str, body: bytes, key: str) -> str:
    # The request itself goes into the key: an assertion for one change opens no other. The path is taken
    # decoded: a slot id's ':' may be sent quoted and arrive unquoted (the client's URL normalisation).
    return "person\0" + "\0".join([method.upper(), unquote(path), hashlib.sha256(body).hexdigest(), key])


def assert_person(
    secret: SecretStr | str,
    person: str,
    rights: str,
    *,
    method: str,
    path: str,
    body: bytes,
    idempotency_key: str,
    now: float | None = None,
) -> str:
    """The `PERSON_HEADER` value for one request a delegate sends for `person`, who signed in with `rights`."""
    if rights not in SIGN_IN_AS:
        raise ValueError(f"a person signs in with one of {SIGN_IN_AS}, not {rights!r}")
    return mint(
        secret,
        rights,
        person,
        purpose=_purpose(method, path, body, idempotency_key),
        ttl_s=ASSERTION_TTL_S,
        now=now,
    )


def verify_person(
    secret: SecretStr | str,
    token: str,
    *,
    method: str,
    path: str,
    body: bytes,
    idempotency_key: str,
    now: float | None = None,
) -> tuple[str, str] | None:
    """(person, the rights they signed in with) when `secret` signed `token` for this very request and it has not
    expired; None otherwise."""
    keys: dict[str, SecretStr | str] = dict.fromkeys(SIGN_IN_AS, secret)
    signed, _ = verify(keys, token, purpose=_purpose(method, path, body, idempotency_key), now=now)
    return None if signed is None else (signed.actor, signed.principal)
