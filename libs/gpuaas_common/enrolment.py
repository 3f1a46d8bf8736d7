"""The enrolment proof of a baremetal host, computed the same way by all three parties.

The MAAS gateway puts a one-time token in the deploy's user-data; the host's agent sends back only the
token's sha256 (the token never travels in events); the allocator recomputes both from the shared
secret and compares. Each side calling its own copy of this arithmetic is how they drift apart.
"""

from __future__ import annotations

import hashlib
import hmac


def enrolment_token(secret: str, allocation_id: str, system_id: str) -> str:
    """The token the gateway writes into the host's user-data: bound to one allocation on one machine."""
    return hmac.new(secret.encode(), f"{allocation_id}:{system_id}".encode(), hashlib.sha256).hexdigest()


def token_proof(token: str) -> str:
    """What the host sends when it enrols."""
    return hashlib.sha256(token.encode()).hexdigest()


def enrolment_proof(secret: str, allocation_id: str, system_id: str) -> str:
    """The proof the allocator expects from the host deployed for this allocation."""
    return token_proof(enrolment_token(secret, allocation_id, system_id))
