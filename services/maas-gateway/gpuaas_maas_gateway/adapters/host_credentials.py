"""Credentials of baremetal hosts: minted for a deploy's user-data, revoked when the allocation ends; and the
end of a slice host's identity when the host is deployed for a tenant.

A baremetal host is the tenant's own root machine, so its NATS user is bound to one allocation
(`allocation:<id>` tag), expires on its own, and is revoked at once when the allocation is released or
its deploy fails. The gateway holds no key: it asks the credential authority (adapters/credential_authority.py),
which mints only host users of the fixed host template and revokes only what it minted for an allocation.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from gpuaas_common.logging import get_logger
from gpuaas_common.unit_of_work import UnitOfWork

from .credential_authority import AuthorityClient
from .repository import GatewayRepositories

log = get_logger(__name__)


class HostCredentials:
    def __init__(
        self,
        authority: AuthorityClient,
        unit_of_work: Callable[[], UnitOfWork[GatewayRepositories]],
        *,
        ttl_s: float,
    ) -> None:
        self.authority = authority
        self.unit_of_work = unit_of_work
        self.ttl_s = ttl_s

    async def issue(self, allocation_id: str, node_id: str, *, command_seq: int, slice_host: bool = False) -> str:
        """A fresh creds file text for the host; its public key is recorded before it can be used. A slice-host
        redeploy (`slice_host`) gets a slice host's own user, as onboarding gives one: recorded by the authority
        as the host's, renewed like an onboarded host's, ended before its next tenant's deploy. `command_seq`: the
        deploy command's place in the MAAS stream, which the authority reads to see that it asks for this user."""
        if slice_host:
            minted = await self.authority.mint_slice_host(node_id, allocation_id, deploy_command_seq=command_seq)
            log.info("slice_host_credentials_issued", node_id=node_id, walk_id=allocation_id, user=minted.user)
            return minted.creds
        minted = await self.authority.mint(node_id, allocation_id, self.ttl_s, deploy_command_seq=command_seq)
        expires = datetime.fromtimestamp(minted.expires_at, UTC)
        async with self.unit_of_work() as uow:
            await uow.repos.host_credentials.record(minted.user, allocation_id, node_id, expires)
            await uow.commit()
        log.info("host_credentials_issued", node_id=node_id, allocation_id=allocation_id, user=minted.user)
        return minted.creds

    async def end_slice_identity(self, node_id: str, keep_allocation: str | None = None) -> int:
        """Revoke the host's slice-host users (recorded on the bus at onboarding) before it is deployed again,
        for a tenant (who gets root on the disk that holds their creds file) or with the slice-host profile
        (a new OS, given a new user). Users minted for an earlier deploy of the machine go too (a slice host
        redeployed by the scheduler's walk got its user that way, not through onboarding); `keep_allocation`
        is the deploy at hand, whose user is minted after this. Idempotent: once they are revoked nothing more
        is pushed."""
        revoked = await self.authority.end_slice_identity(node_id)
        if revoked:
            log.info("slice_host_credentials_revoked", node_id=node_id, users=revoked)
        async with self.unit_of_work() as uow:
            earlier = await uow.repos.host_credentials.live_allocations_of_node(node_id, keep_allocation)
        for allocation_id in earlier:
            revoked += await self.revoke_allocation(allocation_id)
        return revoked

    async def revoke_allocation(self, allocation_id: str) -> int:
        """Revoke every live key of the allocation; idempotent, so a retried release is harmless."""
        async with self.unit_of_work() as uow:
            keys = await uow.repos.host_credentials.live(allocation_id)
        if not keys:
            return 0
        # Asked outside any transaction: a revocation that went through but was not recorded is simply asked
        # again by the next attempt (the authority then finds nothing left to revoke).
        await self.authority.revoke_allocation(allocation_id)
        async with self.unit_of_work() as uow:
            await uow.repos.host_credentials.mark_revoked(keys)
            await uow.commit()
        log.info("host_credentials_revoked", allocation_id=allocation_id, users=len(keys))
        return len(keys)
