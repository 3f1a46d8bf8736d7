"""Credentials of baremetal hosts: minted for a deploy's user-data, revoked when the allocation ends.

A baremetal host is the tenant's own root machine, so its NATS user is bound to one allocation
(`allocation:<id>` tag), expires on its own, and is revoked at once when the allocation is released or
its deploy fails. The gateway holds only the scoped host-signing key (which cannot sign anything but
host users with the fixed host template) and the means to push a revocation.
"""

from __future__ import annotations

import ssl
from datetime import datetime, timedelta, timezone

import asyncpg

from gpuaas_common.identity import Issuer
from gpuaas_common.logging import get_logger

log = get_logger(__name__)


class HostCredentials:
    def __init__(self, issuer: Issuer, pool: asyncpg.Pool, servers: list[str], *, tls: ssl.SSLContext | None,
                 ttl_s: float) -> None:
        self.issuer = issuer
        self.pool = pool
        self.servers = servers
        self.tls = tls
        self.ttl_s = ttl_s

    async def issue(self, allocation_id: str, node_id: str) -> str:
        """A fresh creds file text for the host; its public key is recorded before it can be used."""
        creds = self.issuer.issue_node(node_id, ttl_s=self.ttl_s, allocation_id=allocation_id)
        expires = datetime.now(timezone.utc) + timedelta(seconds=self.ttl_s)
        await self.pool.execute(
            "INSERT INTO maas_host_credentials (user_public, allocation_id, node_id, expires_at) "
            "VALUES ($1, $2, $3, $4)", str(creds.claims["sub"]), allocation_id, node_id, expires)
        log.info("host_credentials_issued", node_id=node_id, allocation_id=allocation_id, user=creds.claims["sub"])
        return creds.render()

    async def revoke_allocation(self, allocation_id: str) -> int:
        """Revoke every live key of the allocation; idempotent, so a retried release is harmless."""
        rows = await self.pool.fetch(
            "SELECT user_public FROM maas_host_credentials WHERE allocation_id = $1 AND revoked_at IS NULL",
            allocation_id)
        keys = [r["user_public"] for r in rows]
        if not keys:
            return 0
        await self.issuer.revoke(self.servers, keys, tls=self.tls, prune_older_than_s=self.ttl_s * 2)
        await self.pool.execute(
            "UPDATE maas_host_credentials SET revoked_at = now() WHERE user_public = ANY($1::text[])", keys)
        log.info("host_credentials_revoked", allocation_id=allocation_id, users=len(keys))
        return len(keys)
