"""What a caller may ask of the authority, decided before any key is touched.

A request names a host, an allocation, a lifetime and the deploy command that asked for the host (by its sequence
in the MAAS stream, which the authority reads itself: domain/deploy_commands.py); the authority mints nothing but
a host user of the fixed host template (the scoped key's), bound to that allocation. These rules keep a caller from
widening that: ids that could not be a node or an allocation are refused, and a lifetime is capped, never trusted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The contract's node id, less '.': the host template expands the node tag into subject tokens, where a '.' would
# split one token into two and name subjects of another shape. Allocation ids are UUIDs.
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_:-]{0,127}$")
_ALLOCATION = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
MIN_TTL_S = 60.0


class GrantRefused(ValueError):
    """A request the authority will not act on; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def node_id(value: object) -> str:
    if not isinstance(value, str) or not _NODE.match(value):
        raise GrantRefused("node_id", "not a node id (letters, digits, '-', '_' and ':', at most 128)")
    return value


def allocation_id(value: object) -> str:
    if not isinstance(value, str) or not _ALLOCATION.match(value):
        raise GrantRefused("allocation_id", "not an allocation id (a UUID)")
    return value.lower()


def deploy_command_seq(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GrantRefused("deploy_command_seq", "the deploy command's sequence in the MAAS stream (an integer >= 1)")
    return value


def _object(body: object) -> dict[str, object]:
    if not isinstance(body, dict):
        raise GrantRefused("body", "a JSON object is expected")
    return body


@dataclass(frozen=True)
class HostUserGrant:
    node_id: str
    allocation_id: str
    ttl_s: float
    deploy_command_seq: int


@dataclass(frozen=True)
class SliceHostGrant:
    node_id: str
    # The scheduler's host walk that redeploys the node as a slice host (its deploy command's allocation_id).
    walk_id: str
    deploy_command_seq: int


def host_user_grant(body: object, *, max_ttl_s: float) -> HostUserGrant:
    """The grant a mint request asks for, with its lifetime capped at `max_ttl_s`."""
    fields = _object(body)
    ttl = fields.get("ttl_s", max_ttl_s)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl < MIN_TTL_S:
        raise GrantRefused("ttl_s", f"a number of seconds, at least {MIN_TTL_S:g}")
    return HostUserGrant(
        node_id(fields.get("node_id")),
        allocation_id(fields.get("allocation_id")),
        min(ttl, max_ttl_s),
        deploy_command_seq(fields.get("deploy_command_seq")),
    )


def slice_host_grant(node: object, body: object) -> SliceHostGrant:
    """A slice host's own user for `node` (from the path), redeployed by the walk the body names."""
    fields = _object(body)
    try:
        walk = allocation_id(fields.get("walk_id"))
    except GrantRefused:
        raise GrantRefused("walk_id", "not a host walk's id (a UUID)") from None
    return SliceHostGrant(node_id(node), walk, deploy_command_seq(fields.get("deploy_command_seq")))
