"""OAuth 1.0 PLAINTEXT verification, the way MAAS checks API keys.

MAAS keys are `consumer_key:token_key:token_secret` with an empty consumer secret, so a valid
signature is the percent-encoded `&<token_secret>`. The checks run in MAAS's order (consumer, token,
timestamp, nonce, signature) so a bad request fails with the same message it would get from MAAS.
"""

from __future__ import annotations

import secrets
import string
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import unquote

from .errors import BadRequest, Unauthorized

REQUIRED_PARAMS = (
    "oauth_consumer_key",
    "oauth_token",
    "oauth_signature",
    "oauth_signature_method",
    "oauth_timestamp",
    "oauth_nonce",
)
TIMESTAMP_WINDOW_SECONDS = 300


@dataclass(frozen=True)
class ApiKey:
    consumer_key: str
    token_key: str
    token_secret: str = field(repr=False)

    @classmethod
    def parse(cls, api_key: str) -> ApiKey:
        parts = api_key.split(":")
        if len(parts) != 3 or not all(parts):
            raise ValueError("an API key has three colon-separated parts")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.consumer_key}:{self.token_key}:{self.token_secret}"


def generate_api_key() -> ApiKey:
    """A fresh key in MAAS's shape (18, 18 and 32 alphanumeric characters)."""
    alphabet = string.ascii_letters + string.digits

    def pick(n: int) -> str:
        return "".join(secrets.choice(alphabet) for _ in range(n))

    return ApiKey(pick(18), pick(18), pick(32))


def parse_authorization(header: str) -> dict[str, str]:
    """Split an `OAuth k="v", …` header the way MAAS does: on commas, realm skipped, values unquoted."""
    text = header.strip()
    if text[:6].lower() == "oauth ":
        text = text[6:]
    params: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            continue
        key = key.strip()
        if key == "realm":
            continue
        params[key] = unquote(value.strip().strip('"'))
    return params


class OAuthVerifier:
    """Checks signed requests against known keys and remembers nonces for the timestamp window."""

    def __init__(
        self,
        keys: Iterable[ApiKey],
        *,
        wall_clock: Callable[[], float] = time.time,
        window_seconds: int = TIMESTAMP_WINDOW_SECONDS,
    ) -> None:
        self._keys = {k.consumer_key: k for k in keys}
        self._wall_clock = wall_clock
        self._window = window_seconds
        self._nonces: dict[tuple[str, str, str], float] = {}

    def add_key(self, key: ApiKey) -> None:
        self._keys[key.consumer_key] = key

    def verify(self, authorization: str | None, query: dict[str, str] | None = None) -> ApiKey:
        params: dict[str, str] = {}
        if query:
            params.update({k: v for k, v in query.items() if k.startswith("oauth_")})
        if authorization and authorization.strip().lower().startswith("oauth"):
            params.update(parse_authorization(authorization))
        if not params:
            raise Unauthorized("Authorization Error: Authentication credentials were not provided.")
        missing = [p for p in REQUIRED_PARAMS if not params.get(p)]
        if missing:
            raise BadRequest("Bad Request: Missing OAuth parameter(s): " + ", ".join(missing))

        key = self._keys.get(params["oauth_consumer_key"])
        if key is None:
            raise Unauthorized("Authorization Error: Invalid API key.")
        if params["oauth_token"] != key.token_key:
            raise Unauthorized(f"Authorization Error: 'Invalid access token: {params['oauth_token']}'")
        if params["oauth_signature_method"].upper() != "PLAINTEXT":
            raise Unauthorized(
                f"Authorization Error: Signature method {params['oauth_signature_method']!r} not supported."
            )
        now = self._wall_clock()
        try:
            timestamp = int(params["oauth_timestamp"])
        except ValueError:
            raise BadRequest("Bad Request: Invalid timestamp.") from None
        if abs(now - timestamp) > self._window:
            raise Unauthorized(
                f"Authorization Error: Expired timestamp: given {timestamp} and now {int(now)} "
                f"has a greater difference than threshold {self._window}"
            )
        self._forget_old_nonces(now)
        nonce_key = (key.consumer_key, key.token_key, params["oauth_nonce"])
        if nonce_key in self._nonces:
            raise Unauthorized(f"Authorization Error: Nonce already used: {params['oauth_nonce']}")
        self._nonces[nonce_key] = now
        # The consumer secret is always empty, so the signature is "&" + token secret.
        if not secrets.compare_digest(params["oauth_signature"], "&" + key.token_secret):
            raise Unauthorized("Authorization Error: Invalid signature.")
        return key

    def _forget_old_nonces(self, now: float) -> None:
        # A nonce outside the window can never be replayed because its timestamp would be rejected.
        horizon = now - 2 * self._window
        stale = [k for k, seen in self._nonces.items() if seen < horizon]
        for k in stale:
            del self._nonces[k]
