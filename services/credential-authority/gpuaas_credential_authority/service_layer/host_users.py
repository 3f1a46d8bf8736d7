"""What a caller may ask for: a baremetal host's user for one allocation, the revocation of what was minted for an
allocation, a slice host's own user (a converting host redeployed as a slice host), and the end of a slice host's
identity before a tenant gets its disk.

What may be revoked is read from the ledger, never taken from the request: a caller names an allocation, and only
the users minted for it go. So a compromised caller can end host users, which it could anyway by releasing, but
never a service's, the portal's or an operator's.

A node has one live host user at most: a mint claims the node in the ledger (compare-and-set) before its user
leaves, and is refused while any user of the node (minted here, onboarded or renewed) is unexpired and unrevoked.
So a caller cannot hold a second identity of a host beside the one the host runs with; the gateway ends the
node's users before each deploy (`end_slice_identity`), and the deploy's mint follows.

And a mint follows a deploy command on the bus (issue 38): the request names the command's sequence in the MAAS
stream, the authority reads it there, and mints only for the node and allocation (or host walk) it names, from the
producer that may ask for that user, while it is recent (domain/deploy_commands.py). Checked before the node is
claimed: a refused mint writes nothing to the ledger.

A revoke by allocation ends the allocation for good, even when no user of it is left: it is marked ended in the
ledger before its users are revoked (a crash in between leaves it ended, and the gateway's retried revoke finds the
users), and a tenant's mint for an ended allocation is refused (allocation_ended), so its deploy command, named
again within its age limit, gives it no host user back. The gateway's retries of a deploy still mint: before each it
ends the node's users (`end_slice_identity`), which ends no allocation. The marks are pruned at each revoke once older
than the command age limit (and a margin): past it the commands they would refuse are refused as old anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from gpuaas_common.identity import Authority
from gpuaas_common.logging import get_logger

from ..adapters.deploy_commands import DeployCommands
from ..adapters.ledger import Ledger
from ..domain.deploy_commands import (
    DeployCommandRefused,
    MintAsked,
    Minting,
    check_allocation_open,
    check_deploy_command,
)
from ..domain.grants import HostUserGrant, SliceHostGrant

log = get_logger(__name__)

# How much longer than the command age limit an allocation's end is kept: a command's age is the server's clock,
# the end's this process's, and the two may differ by a little.
ENDED_KEPT_PAST_MAX_AGE_S = 600.0


@dataclass(frozen=True)
class MintedUser:
    creds: str
    user: str
    expires_at: int


class HostUsers:
    def __init__(
        self,
        authority: Authority,
        ledger: Ledger,
        commands: DeployCommands,
        *,
        max_command_age_s: float,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.authority = authority
        self.ledger = ledger
        self.commands = commands
        self.max_command_age_s = max_command_age_s
        self.clock = clock

    async def _deployed(self, asked: MintAsked) -> None:
        """Returns when the named deploy command asks for this mint; DeployCommandRefused otherwise."""
        stored = await self.commands.at(asked.deploy_command_seq)
        check_deploy_command(stored, asked, now=self.clock(), max_age_s=self.max_command_age_s)

    async def _open(self, allocation_id: str) -> None:
        check_allocation_open(allocation_id, await self.ledger.ended_allocations())

    async def _still_open(self, allocation_id: str, user: str) -> None:
        """After the user is recorded: a revoke that ran since `_open` marked the allocation ended before it read
        the allocation's users, maybe before this one was recorded. Then this user, which has not left, is revoked
        here and the mint refused like any other for an ended allocation."""
        try:
            await self._open(allocation_id)
        except DeployCommandRefused:
            await self.ledger.revoke(self.authority, [user])
            raise

    async def mint(self, grant: HostUserGrant, caller: str) -> MintedUser:
        await self._deployed(MintAsked(Minting.HOST_USER, grant.node_id, grant.allocation_id, grant.deploy_command_seq))
        await self._open(grant.allocation_id)
        creds = self.authority.issuer().issue_node(grant.node_id, ttl_s=grant.ttl_s, allocation_id=grant.allocation_id)
        user, expires_at = str(creds.claims["sub"]), int(creds.claims["exp"])
        # The node first (refused: nothing leaves, nothing else is recorded), then the allocation: recorded
        # before it leaves, as a user the ledger does not hold could not be revoked by allocation.
        await self.ledger.claim_node(grant.node_id, user, expires_at)
        await self.ledger.record_allocation_user(grant.allocation_id, user, expires_at)
        await self._still_open(grant.allocation_id, user)
        log.info(
            "host_user_minted",
            node_id=grant.node_id,
            allocation_id=grant.allocation_id,
            user=user,
            expires_at=expires_at,
            caller=caller,
            deploy_command_seq=grant.deploy_command_seq,
        )
        return MintedUser(creds.render(), user, expires_at)

    async def mint_slice_host(self, grant: SliceHostGrant, caller: str) -> MintedUser:
        """A slice host's own user, as onboarding issues it (no allocation; the host template; 72 h, renewed at
        half-life where its file is renewed): recorded as the host's before it leaves, so the host's slice identity
        ends with the others' before a tenant's deploy. Only for the scheduler's slice-host redeploy of the node."""
        node_id = grant.node_id
        await self._deployed(MintAsked(Minting.SLICE_HOST_USER, node_id, grant.walk_id, grant.deploy_command_seq))
        creds = self.authority.issue_host(node_id)
        user, expires_at = str(creds.claims["sub"]), int(creds.claims["exp"])
        await self.ledger.claim_node(node_id, user, expires_at)
        await self.ledger.record_host_user(node_id, user, expires_at)
        log.info(
            "slice_host_user_minted",
            node_id=node_id,
            walk_id=grant.walk_id,
            user=user,
            expires_at=expires_at,
            caller=caller,
            deploy_command_seq=grant.deploy_command_seq,
        )
        return MintedUser(creds.render(), user, expires_at)

    async def revoke_allocation(self, allocation_id: str, caller: str) -> int:
        """End the allocation (marked first, even with no user left) and revoke its users not yet revoked; 0 when
        none is left (nothing is pushed then)."""
        await self.ledger.end_allocation(allocation_id, keep_s=self.max_command_age_s + ENDED_KEPT_PAST_MAX_AGE_S)
        revoked = await self.ledger.revoked()
        live = [u for u in await self.ledger.allocation_users(allocation_id) if u not in revoked]
        if live:
            await self.ledger.revoke(self.authority, live)
        log.info("allocation_users_revoked", allocation_id=allocation_id, users=len(live), caller=caller)
        return len(live)

    async def end_slice_identity(self, node_id: str, caller: str) -> int:
        revoked = await self.ledger.end_slice_identity(self.authority, node_id)
        log.info("slice_identity_ended", node_id=node_id, users=revoked, caller=caller)
        return revoked
