"""Issuing users again before they expire: the issuer's half of renewal (the process's half is `creds_renewal`).

A creds file is due once less than half of its lifetime is left. It is then rewritten, atomically, with a new
user of the same identity, and the process that reads it switches to it live. Whoever holds the keys runs this
periodically: `gpuaas identities renew --every` in a deployment (compose's `identities-renewer`), a thread of
the dev stack. Nothing on the bus asks for it and nothing on the bus can: a process never mints its own.

- Roles (services, portal, ops): a new user with the role's permissions (24 h by default). Admin is renewed
  only where asked (the dev stack's break-glass file): no running service holds it.
- Slice hosts: a new host user (72 h by default), recorded on the bus before its file is written, so the gateway
  can end it like any other; at once, due or not, for a host user made before hosts had their own account (an
  upgraded deployment's: the servers refuse those). Never for a host whose user is revoked (its slice life ended:
  a baremetal tenant has the machine) or already expired (a host no renewal reached, whose mode is not known): it
  comes back through onboarding. A revocation that lands while a renewal runs is caught by looking again once the new
  user is recorded: the new user is revoked too and the file left as it was.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import creds as creds_mod
from .authority import (
    ADMIN_USER_TTL_S,
    DEFAULT_USER_TTL_S,
    HOST_USER_TTL_S,
    Authority,
    record_host_users,
    revoked_users,
)
from .creds import Creds
from .jwt import JwtError
from .permissions import ADMIN, NODE_TAG, ROLE_PERMISSIONS

# Renewed once less than this share of the lifetime is left: half, so a renewal that fails has as long again.
RENEW_FRACTION = 0.5


def kept_owner(path: Path) -> tuple[int, int] | None:
    """The owner of the file a renewal replaces, where we may give a file away (root): a renewal changes what a
    file holds, never who may read it (compose gives each file to its one reader)."""
    if os.geteuid() != 0:
        return None
    st = path.stat()
    return (st.st_uid, st.st_gid)


def renewal_due(creds: Creds, *, now: float | None = None, fraction: float = RENEW_FRACTION) -> bool:
    claims = creds.claims
    exp = claims.get("exp")
    if not exp:
        return False  # no expiry: nothing to renew (we never issue one)
    now = time.time() if now is None else now
    return bool(exp - now < (exp - claims.get("iat", now)) * fraction)


def _before_hosts_account(creds: Creds, authority: Authority) -> bool:
    """A host user issued before hosts had an account of their own (HOSTS): the servers refuse it since, so an
    upgraded deployment's hosts get their user again at the first renewal round, due or not."""
    return creds.claims.get("nats", {}).get("issuer_account") != authority.hosts_account.public


def _expired(creds: Creds, now: float) -> bool:
    exp = creds.claims.get("exp")
    return bool(exp and exp <= now)


def renew_role_files(
    authority: Authority,
    creds_dir: Path,
    *,
    ttl_s: float = DEFAULT_USER_TTL_S,
    include_admin: bool = False,
    owner: tuple[int, int] | None = None,
    now: float | None = None,
) -> list[str]:
    """Issue again each role's creds file in `creds_dir` that is due (or unreadable); a role without a file
    there is not issued here. The new file is `owner`'s, else the old one's owner's. Returns the roles renewed."""
    renewed = []
    for role, perms in ROLE_PERMISSIONS.items():
        if role == ADMIN and not include_admin:
            continue
        path = creds_dir / f"{role}.creds"
        if not path.exists():
            continue
        try:
            if not renewal_due(creds_mod.read(path), now=now):
                continue
        except (OSError, JwtError):
            pass  # unreadable or damaged: issued again
        ttl = ADMIN_USER_TTL_S if role == ADMIN else ttl_s
        creds_mod.write(path, authority.issue_user(role, perms, ttl_s=ttl), owner=owner or kept_owner(path))
        renewed.append(role)
    return renewed


def host_files(hosts_dir: Path) -> dict[str, Path]:
    """node id → creds file, for every host user's file in `hosts_dir` (read from the JWT's node tag)."""
    out = {}
    for path in sorted(hosts_dir.glob("*.creds")):
        try:
            tags = creds_mod.read(path).claims.get("nats", {}).get("tags") or []
        except (OSError, JwtError):
            continue
        nodes = [t.split(":", 1)[1] for t in tags if t.startswith(f"{NODE_TAG}:")]
        if nodes and not any(t.startswith("allocation:") for t in tags):  # a baremetal host's user is not ours
            out[nodes[0]] = path
    return out


async def renew_host_files(
    authority: Authority,
    files: Mapping[str, Path],
    *,
    js: Any,
    nats_servers: list[str],
    tls: Any = None,
    ttl_s: float = HOST_USER_TTL_S,
    owner: tuple[int, int] | None = None,
    now: float | None = None,
) -> dict[str, str]:
    """Renew each slice host's file (node id → path) that is due. `js`: a connection allowed on the identity
    ledger (admin). Returns node id → 'renewed', 'revoked' (its slice life ended) or 'expired' (left alone);
    the caller saves `authority` (its issued hosts changed)."""
    now = time.time() if now is None else now
    revoked = await revoked_users(js)
    out: dict[str, str] = {}
    for node_id, path in files.items():
        try:
            current = creds_mod.read(path)
        except (OSError, JwtError):
            continue
        user = str(current.claims["sub"])
        if user in revoked:
            out[node_id] = "revoked"
            continue
        if _expired(current, now):
            out[node_id] = "expired"
            continue
        if not renewal_due(current, now=now) and not _before_hosts_account(current, authority):
            continue
        fresh = authority.issue_host(node_id, ttl_s=ttl_s)
        new_user = str(fresh.claims["sub"])
        await record_host_users(js, node_id, [new_user], expiry=authority.host_expiry)
        if user in await revoked_users(js):  # ended while we renewed: the new user goes with it
            await authority.issuer().revoke(nats_servers, [new_user], js=js, tls=tls)
            out[node_id] = "revoked"
            continue
        creds_mod.write(path, fresh, owner=owner or kept_owner(path))
        out[node_id] = "renewed"
    return out
