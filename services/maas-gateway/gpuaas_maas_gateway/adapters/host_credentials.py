"""Credentials of baremetal hosts: minted for a deploy's user-data, revoked when the allocation ends; and the
end of a slice host's identity when the host is deployed for a tenant.

A baremetal host is the tenant's own root machine, so its NATS user is bound to one allocation
(`allocation:<id>` tag), expires on its own, and is revoked at once when the allocation is released or
its deploy fails. The gateway holds only the scoped host-signing key (which cannot sign anything but
host users with the fixed host template) and the means to push a revocation.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuaas_common.identity import Issuer
from gpuaas_common.logging import get_logger
from gpuaas_common.unit_of_work import UnitOfWork

from .repository import GatewayRepositories

log = get_logger(__name__)


class HostCredentials:
    def __init__(
        self,
        issuer: Issuer,
        unit_of_work: Callable[[], UnitOfWork[GatewayRepositories]],
        servers: list[str],
        *,
        js: Any,
        tls: ssl.SSLContext | None,
        ttl_s: float,
    ) -> None:
        self.js = js  # the gateway's own connection: it keeps the revocation ledger with it
        self.issuer = issuer
        self.unit_of_work = unit_of_work
        self.servers = servers
        self.tls = tls
        self.ttl_s = ttl_s

    async def issue(self, allocation_id: str, node_id: str) -> str:
        """A fresh creds file text for the host; its public key is recorded before it can be used."""
        creds = self.issuer.issue_node(node_id, ttl_s=self.ttl_s, allocation_id=allocation_id)
        expires = datetime.now(UTC) + timedelta(seconds=self.ttl_s)
        async with self.unit_of_work() as uow:
            await uow.repos.host_credentials.record(str(creds.claims["sub"]), allocation_id, node_id, expires)
            await uow.commit()
        log.info("host_credentials_issued", node_id=node_id, allocation_id=allocation_id, user=creds.claims["sub"])
        return creds.render()

    async def end_slice_identity(self, node_id: str) -> int:
        """Revoke the host's slice-host users (recorded on the bus at onboarding) before it is deployed for a
        tenant, who gets root on the disk that holds their creds file. Idempotent: once they are revoked
        nothing more is pushed."""
        revoked = await self.issuer.end_slice_identity(self.servers, node_id, js=self.js, tls=self.tls)
        if revoked:
            log.info("slice_host_credentials_revoked", node_id=node_id, users=revoked)
        return revoked

    async def revoke_allocation(self, allocation_id: str) -> int:
        """Revoke every live key of the allocation; idempotent, so a retried release is harmless."""
        async with self.unit_of_work() as uow:
            keys = await uow.repos.host_credentials.live(allocation_id)
        if not keys:
            return 0
        # Pushed to NATS outside any transaction: a revocation that went through but was not recorded is
        # simply pushed again by the next attempt (revoking twice is harmless).
        # No shorter pruning than the default: the ledger also holds slice hosts' year-long users.
        await self.issuer.revoke(self.servers, keys, js=self.js, tls=self.tls)
        async with self.unit_of_work() as uow:
            await uow.repos.host_credentials.mark_revoked(keys)
            await uow.commit()
        log.info("host_credentials_revoked", allocation_id=allocation_id, users=len(keys))
        return len(keys)
