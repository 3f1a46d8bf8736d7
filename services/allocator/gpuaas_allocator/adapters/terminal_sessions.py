"""The slice terminal's audit rows (allocator.terminal_sessions): one per session, written when it opens and
completed when it ends."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg


class TerminalSessionRepository:
    """The terminal's statements, on the unit of work's connection and in its transaction
    (service_layer/ports.py: `TerminalSessions`)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def lock_allocation(self, allocation_id: uuid.UUID) -> dict[str, Any] | None:
        """The allocation's row as a terminal needs it, locked until the transaction ends: a release that starts
        meanwhile waits, so a session is never opened into an allocation already on its way out."""
        row = await self.conn.fetchrow(
            "SELECT allocation_id, tenant_id, shape, state, node_id FROM allocations "
            "WHERE allocation_id = $1 FOR UPDATE",
            allocation_id,
        )
        return dict(row) if row else None

    async def lock_tenant(self, tenant_id: str) -> None:
        """Opens of one tenant's sessions, on any replica, one after another until the transaction ends: the
        count of its live sessions is then the one its cap is checked against."""
        await self.conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('terminal:' || $1, 0))", tenant_id)

    async def end_stale_sessions(self, tenant_id: str, stale_after_s: float) -> int:
        """Ends the tenant's live sessions whose replica stopped renewing its claim (it is gone, and so is the
        websocket): they no longer count against the tenant or hold their allocation."""
        status = await self.conn.execute(
            "UPDATE terminal_sessions SET ended_at = now(), end_reason = 'replica_gone' "
            "WHERE tenant_id = $1 AND ended_at IS NULL AND seen_at < now() - make_interval(secs => $2)",
            tenant_id,
            stale_after_s,
        )
        return int(status.split()[-1])

    async def live_counts(self, tenant_id: str, allocation_id: uuid.UUID) -> tuple[int, int]:
        """(live sessions on the allocation, live sessions of the tenant)."""
        row = await self.conn.fetchrow(
            "SELECT count(*) FILTER (WHERE allocation_id = $2) AS here, count(*) AS tenant FROM terminal_sessions "
            "WHERE tenant_id = $1 AND ended_at IS NULL",
            tenant_id,
            allocation_id,
        )
        assert row is not None
        return int(row["here"]), int(row["tenant"])

    async def insert_session(
        self,
        *,
        session_id: uuid.UUID,
        allocation_id: uuid.UUID,
        tenant_id: str,
        actor: str,
        node_id: str,
        task_id: str,
        replica_id: str,
    ) -> None:
        await self.conn.execute(
            "INSERT INTO terminal_sessions (session_id, allocation_id, tenant_id, actor, node_id, task_id, "
            "replica_id) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            session_id,
            allocation_id,
            tenant_id,
            actor,
            node_id,
            task_id,
            replica_id,
        )

    async def renew_claims(self, session_ids: list[uuid.UUID]) -> None:
        """This replica still holds these sessions' websockets."""
        await self.conn.execute(
            "UPDATE terminal_sessions SET seen_at = now() WHERE session_id = ANY($1::uuid[]) AND ended_at IS NULL",
            session_ids,
        )

    async def end_session(
        self, session_id: uuid.UUID, *, reason: str, bytes_to_guest: int, bytes_from_guest: int
    ) -> bool:
        """Completes the row once (a second end changes nothing): whether this call ended it."""
        status = await self.conn.execute(
            "UPDATE terminal_sessions SET ended_at = now(), end_reason = $2, bytes_to_guest = $3, "
            "bytes_from_guest = $4 WHERE session_id = $1 AND ended_at IS NULL",
            session_id,
            reason,
            bytes_to_guest,
            bytes_from_guest,
        )
        return bool(status == "UPDATE 1")
