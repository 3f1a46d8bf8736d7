"""The MAAS API key: OAuth 1.0 PLAINTEXT signing, and scrubbing the key out of anything MAAS echoes back."""

from __future__ import annotations

from typing import Any

from oauthlib import oauth1

_REDACTED = "**redacted**"


class _Credentials:
    """The three parts of a MAAS API key; deliberately opaque to repr, str and pickling."""

    __slots__ = ("_consumer_key", "_token_key", "_token_secret")

    def __init__(self, api_key: str) -> None:
        parts = api_key.strip().split(":")
        if len(parts) != 3 or not all(parts):
            # Never echo the value: a malformed key is still mostly a secret.
            raise ValueError("a MAAS API key has three colon-separated parts")
        self._consumer_key, self._token_key, self._token_secret = parts

    def signer(self) -> oauth1.Client:
        return oauth1.Client(
            self._consumer_key,
            client_secret="",
            resource_owner_key=self._token_key,
            resource_owner_secret=self._token_secret,
            signature_method=oauth1.SIGNATURE_PLAINTEXT,
            signature_type=oauth1.SIGNATURE_TYPE_AUTH_HEADER,
            realm="OAuth",
        )

    def scrub(self, text: str) -> str:
        for part in (self._token_secret, self._token_key, self._consumer_key):
            text = text.replace(part, _REDACTED)
        return text

    def __repr__(self) -> str:
        return "<MAAS credentials>"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("MAAS credentials cannot be pickled")
