"""NATS nkeys and v2 JWTs: the wire format nats-server checks, written with the `nkeys` package.

We write the claims ourselves instead of using the `nats-jwt` package: its 0.2.2 release writes account
`signing_keys` as a JSON object, which nats-server rejects, has no scoped signing keys (the reason we
use JWTs at all: one template for every host) and pins old dependencies. The format is small and
stable (header, payload, Ed25519 signature over both, unpadded base64url), and every claim we write is
checked by a real nats-server in the tests.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}

PREFIXES = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}


class JwtError(ValueError):
    """A token that is not a well-formed NATS JWT, or whose signature does not verify."""


@dataclass(frozen=True)
class Key:
    """An nkey pair. `seed` is the secret (S…); `public` the identity (O…, A…, U…)."""

    seed: bytes
    public: str

    @classmethod
    def generate(cls, kind: str) -> "Key":
        # nkeys 0.2.1 has no generator: a seed is 32 random bytes with the kind's prefix.
        seed = nkeys.encode_seed(os.urandom(32), PREFIXES[kind])
        return cls.from_seed(seed)

    @classmethod
    def from_seed(cls, seed: bytes | str) -> "Key":
        raw = seed.encode() if isinstance(seed, str) else bytes(seed)
        kp = nkeys.from_seed(bytearray(raw))
        return cls(seed=raw, public=kp.public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return nkeys.from_seed(bytearray(self.seed)).sign(data)

    def __repr__(self) -> str:  # never print the seed
        return f"Key(public={self.public!r})"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _jti(claims: dict[str, Any]) -> str:
    # The Go library's hash: SHA-512/256 over the standard claims in its field order, empties omitted.
    std = {k: claims[k] for k in ("aud", "exp", "iat", "iss", "name", "nbf", "sub") if claims.get(k)}
    digest = hashlib.new("sha512_256", json.dumps(std, separators=(",", ":")).encode()).digest()
    return base64.b32encode(digest).decode().rstrip("=")


def encode(
    issuer: Key,
    subject: str,
    name: str,
    nats: dict[str, Any],
    *,
    expires_at: float | None = None,
    issued_at: float | None = None,
) -> str:
    """Sign a v2 claim set. `issued_at` defaults to now; a re-issued account JWT must carry a later
    `iat` than the one it replaces, or resolvers keep the old one."""
    claims: dict[str, Any] = {
        "jti": "",
        "iat": int(issued_at if issued_at is not None else time.time()),
        "iss": issuer.public,
        "name": name,
        "sub": subject,
    }
    if expires_at is not None:
        claims["exp"] = int(expires_at)
    claims["jti"] = _jti(claims)
    claims["nats"] = {**nats, "version": 2}
    head = _b64(json.dumps(HEADER, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    sig = issuer.sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64(sig)}"


def decode(token: str, *, verify: bool = True) -> dict[str, Any]:
    """The claims of a token; with `verify`, checks the issuer's signature (not expiry or trust)."""
    try:
        head, body, sig = token.strip().split(".")
        header = json.loads(_unb64(head))
        claims = json.loads(_unb64(body))
    except (ValueError, json.JSONDecodeError) as exc:
        raise JwtError(f"malformed JWT: {exc}") from None
    if header.get("alg") != HEADER["alg"]:
        raise JwtError(f"unsupported JWT algorithm {header.get('alg')!r}")
    if verify:
        verify_signature(str(claims.get("iss", "")), f"{head}.{body}".encode(), _unb64(sig))
    return claims


def verify_signature(public: str, data: bytes, sig: bytes) -> None:
    """Check an Ed25519 signature against an nkey public key (nkeys 0.2.1 cannot load a bare public key)."""
    import nacl.exceptions
    import nacl.signing

    try:
        raw = base64.b32decode(public + "=" * (-len(public) % 8))
    except ValueError:
        raise JwtError(f"bad issuer key {public[:8]}…") from None
    if len(raw) != 35 or nkeys.crc16_checksum(raw[:-2]) != raw[-2:]:
        raise JwtError(f"bad issuer key {public[:8]}…")
    try:
        nacl.signing.VerifyKey(raw[1:-2]).verify(data, sig)
    except nacl.exceptions.BadSignatureError:
        raise JwtError("JWT signature does not verify") from None
