"""The slice terminal's rules (slice-node-bootstrap, "Slice Terminal Follow-Up"): who may open one into which
allocation, and one session's byte streams with their offsets. Pure: no I/O."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gpuaas_common.contract import Shape

# Each end of a session, as the audit records it.
END_REASONS = frozenset(
    {
        "client_closed",
        "guest_closed",
        "agent_gone",
        "ssh_failed",
        "deadline",
        "refused",
        "allocation_ended",
        # The replica that held the websocket stopped renewing its claim (it died): a new session may open.
        "replica_gone",
    }
)


@dataclass(frozen=True)
class TerminalRefusal:
    """Why a terminal was not opened; nothing was stored or sent. `status`: the HTTP status it maps to."""

    status: int
    code: str
    reason: str


def terminal_refusal(row: dict[str, Any] | None, allocation_id: uuid.UUID, tenant_id: str) -> TerminalRefusal | None:
    """None when `tenant_id` may open a terminal into the allocation `row` (as the allocator stores it).

    Another tenant's allocation is answered exactly as an unknown one: the refusal says nothing of whether it
    exists."""
    if row is None or row["tenant_id"] != tenant_id:
        return TerminalRefusal(404, "unknown_allocation", f"no allocation {allocation_id} of tenant {tenant_id}")
    if row["shape"] != Shape.GPU_SLICE:
        return TerminalRefusal(
            409, "not_a_slice", "a baremetal host is the tenant's own machine: log in to it directly, no relay"
        )
    if row["state"] != "active":
        return TerminalRefusal(
            409, "allocation_not_active", f"allocation {allocation_id} is {row['state']}: a terminal needs it active"
        )
    if not row.get("node_id"):
        return TerminalRefusal(409, "allocation_not_active", f"allocation {allocation_id} is on no node")
    return None


def session_refusal(live_on_allocation: int, live_of_tenant: int, per_tenant: int) -> TerminalRefusal | None:
    """None when one more session may open: one live session per allocation (a second websocket would be a second
    reader of the same keystrokes, and a second buffer), and at most `per_tenant` for a tenant over all of its
    allocations and every replica."""
    if live_on_allocation:
        return TerminalRefusal(
            409, "terminal_in_use", "this allocation already has a live terminal session: close it first"
        )
    if live_of_tenant >= per_tenant:
        return TerminalRefusal(
            429, "too_many_terminals", f"the tenant has {live_of_tenant} live terminal sessions, the most it may hold"
        )
    return None


class InputWindowFull(ValueError):
    """The tenant typed past what the host has confirmed by more than the window: the frame is refused whole."""


@dataclass
class Stream:
    """One direction of a session's bytes: what was taken and what the other side has acknowledged."""

    buffered: bytearray = field(default_factory=bytearray)
    base: int = 0  # offset of buffered[0]
    total: int = 0  # bytes taken since the session started

    def take(self, offset: int, data: bytes) -> bytes:
        """The part of a chunk sent from `offset` not taken before (a resend after a lost answer is counted once).
        A chunk past what was taken would leave a gap: ValueError."""
        if offset > self.total:
            raise ValueError(f"chunk at {offset} leaves a gap after {self.total}")
        fresh = data[self.total - offset :]
        self.total += len(fresh)
        return fresh

    @property
    def held(self) -> int:
        """Bytes kept for a reader that has not confirmed them."""
        return len(self.buffered)

    def put(self, data: bytes, window: int | None = None) -> None:
        """Keep `data` for the reader; with a `window`, refused whole (InputWindowFull) when the unconfirmed bytes
        would pass it, so what is kept never grows past the window whatever the writer sends."""
        if window is not None and self.held + len(data) > window:
            raise InputWindowFull(f"{self.held} bytes not yet taken by the guest; the window is {window}")
        self.buffered += data
        self.total += len(data)

    def since(self, received: int, limit: int) -> tuple[int, bytes]:
        """What the reader lacks past `received`, up to `limit` bytes, from where; what it has is dropped."""
        if received < self.base or received > self.total:
            raise ValueError(f"reader at {received}, buffer holds {self.base}..{self.total}")
        del self.buffered[: received - self.base]
        self.base = received
        return received, bytes(self.buffered[:limit])
