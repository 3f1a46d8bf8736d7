"""Identities on the bus: NATS operator/account/user JWTs, creds files, per-role permissions, TLS."""

from .authority import Authority, AuthorityError, Issuer
from .creds import Creds
from .jwt import JwtError, Key
from .permissions import ROLE_PERMISSIONS, Permissions, inbox_prefix, role_permissions

__all__ = [
    "Authority",
    "AuthorityError",
    "Issuer",
    "Creds",
    "JwtError",
    "Key",
    "ROLE_PERMISSIONS",
    "Permissions",
    "inbox_prefix",
    "role_permissions",
]
