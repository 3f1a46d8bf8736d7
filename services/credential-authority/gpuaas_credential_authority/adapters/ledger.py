"""The identity ledger on the bus (a JetStream KV bucket in the GPUAAS account), as this process uses it: the
revocation list, each slice host's users, each baremetal allocation's and the allocations that ended. Every write
is compare-and-set (`gpuaas_common.identity.authority`), so replicas of this process, or a one-shot admin step, lose
nothing."""

from __future__ import annotations

import ssl
from typing import Any

from gpuaas_common.identity import Authority
from gpuaas_common.identity.authority import (
    allocation_users,
    claim_node,
    end_allocation,
    ended_allocations,
    record_allocation_users,
    record_host_users,
    revoked_users,
)


class Ledger:
    def __init__(self, js: Any, servers: list[str], tls: ssl.SSLContext | None) -> None:
        self.js = js
        self.servers = servers
        self.tls = tls

    async def revoked(self) -> dict[str, int]:
        return await revoked_users(self.js)

    async def claim_node(self, node_id: str, user: str, expires_at: int) -> None:
        """The node's one live user from now on; NodeHasLiveUser (nothing written) where it has one already."""
        await claim_node(self.js, node_id, user, expires_at)

    async def record_allocation_user(self, allocation_id: str, user: str, expires_at: int) -> None:
        await record_allocation_users(self.js, allocation_id, [user], expiry={user: expires_at})

    async def record_host_user(self, node_id: str, user: str, expires_at: int) -> None:
        await record_host_users(self.js, node_id, [user], expiry={user: expires_at})

    async def allocation_users(self, allocation_id: str) -> list[str]:
        return await allocation_users(self.js, allocation_id)

    async def ended_allocations(self) -> dict[str, int]:
        return await ended_allocations(self.js)

    async def end_allocation(self, allocation_id: str, *, keep_s: float) -> None:
        """Marked for good (pruned once older than `keep_s`); marking an ended allocation again writes nothing."""
        await end_allocation(self.js, allocation_id, keep_s=keep_s)

    async def revoke(self, authority: Authority, users: list[str]) -> None:
        # A system user minted for this push alone (an hour, account claims only): none is kept on disk.
        await authority.issuer().revoke(self.servers, users, js=self.js, tls=self.tls)

    async def end_slice_identity(self, authority: Authority, node_id: str) -> int:
        return await authority.issuer().end_slice_identity(self.servers, node_id, js=self.js, tls=self.tls)
