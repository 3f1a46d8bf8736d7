"""Whether a deploy command on the bus asks for the host user a caller wants minted (issue 38).

A caller names the command by its sequence in the MAAS stream; the authority reads that message itself, so what
it mints follows from what the allocator or the scheduler published, never from what the caller says. A tenant's
host user needs the allocator's deploy of that node for that allocation; a slice host's own user needs the
scheduler's slice-host redeploy of that node, whose allocation_id is the host walk's id. Only those two identities
may publish on the deploy subject (identity/permissions.py), and the envelope's producer says which of them did.

A command is good for a while only: a deploy's user-data is minted soon after its command, and an old command
named again is a replay, not a deploy. The time is the stream's (when the server stored it), not the envelope's.
And a tenant's command asks for nothing once its allocation has ended (its host users revoked: released, or its
deploy failed), however recent: named again after the release, it would give the allocation a host user back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum

from gpuaas_common.bus_parsing import PermanentError, parse_message
from gpuaas_common.contract.messages import MaasDeployRequested

DEPLOY_TYPE = "maas.deploy_requested"
DEPLOY_SUBJECT = "gpuaas.maas.command.deploy"


class Minting(Enum):
    """What is asked for, and whose command may ask for it."""

    HOST_USER = "allocator"
    SLICE_HOST_USER = "scheduler"


@dataclass(frozen=True)
class StoredMessage:
    """One message as the stream holds it."""

    subject: str
    body: bytes
    stored_at: datetime


@dataclass(frozen=True)
class MintAsked:
    minting: Minting
    node_id: str
    # The tenant's allocation (a host user) or the host walk's id (a slice host's user).
    allocation_id: str
    deploy_command_seq: int


class DeployCommandRefused(Exception):
    """No deploy command on the bus asks for this mint; `code` is stable, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_deploy_command(stored: StoredMessage | None, asked: MintAsked, *, now: datetime, max_age_s: float) -> None:
    """Returns when the stored message is the deploy command that asks for `asked`, else DeployCommandRefused."""
    seq = asked.deploy_command_seq
    if stored is None:
        raise DeployCommandRefused("no_deploy_command", f"the MAAS stream holds no message {seq}")
    if stored.subject != DEPLOY_SUBJECT:
        raise DeployCommandRefused("no_deploy_command", f"message {seq} is on {stored.subject}, not a deploy command")
    try:
        envelope, payload = parse_message(stored.subject, stored.body)
    except PermanentError as exc:
        raise DeployCommandRefused("deploy_command_invalid", f"message {seq}: {exc.reason}"[:300]) from None
    if envelope.type != DEPLOY_TYPE or not isinstance(payload, MaasDeployRequested):
        raise DeployCommandRefused("no_deploy_command", f"message {seq} is a {envelope.type}, not a deploy command")
    if envelope.producer != asked.minting.value:
        wanted = "a tenant's host user" if asked.minting is Minting.HOST_USER else "a slice host's user"
        raise DeployCommandRefused(
            "deploy_command_mismatch",
            f"message {seq} was published by {envelope.producer!r}; {wanted} needs {asked.minting.value!r}'s deploy",
        )
    node, allocation = payload.node_id, str(payload.allocation_id).lower()
    if node != asked.node_id:
        raise DeployCommandRefused("deploy_command_mismatch", f"message {seq} deploys node {node!r}, not this one")
    if allocation != asked.allocation_id.lower():
        raise DeployCommandRefused(
            "deploy_command_mismatch", f"message {seq} deploys for {allocation}, not {asked.allocation_id}"
        )
    age = (now - stored.stored_at).total_seconds()
    if age > max_age_s:
        raise DeployCommandRefused(
            "deploy_command_expired",
            f"message {seq} is {age:.0f} s old; a mint follows its command within {max_age_s:g} s",
        )


def check_allocation_open(allocation_id: str, ended: Mapping[str, int]) -> None:
    """Returns while the allocation has not ended (`ended`: the ledger's marks, id → ended at, unix seconds), else
    DeployCommandRefused."""
    at = ended.get(allocation_id.lower())
    if at is not None:
        when = datetime.fromtimestamp(at, UTC).isoformat()
        raise DeployCommandRefused(
            "allocation_ended", f"allocation {allocation_id} ended at {when} (its host users revoked): none is minted"
        )
