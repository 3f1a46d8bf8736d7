"""The slice terminal on the control plane: a tenant's websocket on one side, the host's agent on the other.

Opening is one unit of work: the allocation locked and checked (the tenant's own, a slice, active), the audit
row written and the `slice.terminal_open` task queued to the host, together. The bytes then travel as the
host asks for them (service_layer/../node-agent's terminal: `node.terminal_output` / `node.terminal_input`
requests on the host's own subjects); every replica hears them, and the one holding the session's websocket
answers. Ending completes the audit row once, with the bytes each way and why it ended.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from gpuaas_common.contract import derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.unit_of_work import UnitOfWork

from ..adapters import terminal_sessions as sql
from ..domain.terminal import Stream, TerminalRefusal, terminal_refusal

log = get_logger(__name__)

# A chunk of tenant input per answer: the host's payload limit bounds it, like the output's.
INPUT_CHUNK = m.TERMINAL_CHUNK_MAX
ENDED_KEPT = 1024


class Refused(Exception):
    def __init__(self, refusal: TerminalRefusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


@dataclass
class Session:
    session_id: uuid.UUID
    allocation_id: uuid.UUID
    node_id: str
    to_guest: Stream = field(default_factory=Stream)
    from_guest: Stream = field(default_factory=Stream)
    # Bytes from the guest not yet handed to the websocket, and a wake-up for each side.
    output: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    input_ready: asyncio.Event = field(default_factory=asyncio.Event)
    agent_seen: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    end_reason: str | None = None
    end_detail: str | None = None


class TerminalHub:
    """This replica's open sessions and the answers to their hosts' requests."""

    def __init__(
        self,
        unit_of_work: Callable[[], UnitOfWork[Any]],
        *,
        session_max_s: float,
        input_hold_s: float,
    ) -> None:
        self._uow = unit_of_work
        self.session_max_s = session_max_s
        self.input_hold_s = input_hold_s
        self.sessions: dict[uuid.UUID, Session] = {}
        # Sessions this replica ended lately, by host: a host still relaying one hears `closed` instead of silence.
        self._ended: OrderedDict[uuid.UUID, str] = OrderedDict()

    # --- the tenant's side ------------------------------------------------------------------------------

    async def open(
        self, allocation_id: uuid.UUID, tenant_id: str, actor: str, *, cols: int = 80, rows: int = 24
    ) -> Session:
        """Refused (nothing stored, nothing sent) unless the allocation is the tenant's active slice."""
        session_id = uuid.uuid4()
        task_id = f"terminal-{session_id}"
        async with self._uow() as uow:
            row = await sql.lock_allocation(uow.conn, allocation_id)
            refusal = terminal_refusal(row, allocation_id, tenant_id)
            if refusal is not None:
                log.info("terminal_refused", allocation_id=str(allocation_id), code=refusal.code, actor=actor)
                raise Refused(refusal)
            assert row is not None
            node_id = row["node_id"]
            await sql.insert_session(
                uow.conn,
                session_id=session_id,
                allocation_id=allocation_id,
                tenant_id=tenant_id,
                actor=actor,
                node_id=node_id,
                task_id=task_id,
            )
            task = m.SliceTerminalOpen(
                task_id=task_id,
                session_id=session_id,
                allocation_id=allocation_id,
                node_id=node_id,
                deadline=utcnow() + timedelta(seconds=self.session_max_s),
                cols=cols,
                rows=rows,
            )
            await uow.events.add(
                "slice.terminal_open",
                task,
                aggregate_id=str(allocation_id),
                event_id=derived_event_id(task_id, "open"),
                node_id=node_id,
            )
            session = Session(session_id, allocation_id, node_id)
            self.sessions[session_id] = session  # before the commit: the host may ask as soon as the task is out
            try:
                await uow.commit()
            except BaseException:
                self.sessions.pop(session_id, None)
                raise
        log.info(
            "terminal_opened",
            allocation_id=str(allocation_id),
            session_id=str(session_id),
            node_id=node_id,
            actor=actor,
        )
        return session

    def type(self, session: Session, data: bytes) -> None:
        if session.closed or not data:
            return
        session.to_guest.put(data)
        session.input_ready.set()

    async def close(self, session: Session, reason: str, detail: str | None = None) -> None:
        """End the session (once): the host hears `closed` at its next request, the audit row is completed."""
        if session.end_reason is None:
            session.end_reason, session.end_detail = reason, detail
        session.closed = True
        session.input_ready.set()
        session.output.put_nowait(None)
        if self.sessions.pop(session.session_id, None) is None:
            return
        self._ended[session.session_id] = session.node_id
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        async with self._uow() as uow:
            await sql.end_session(
                uow.conn,
                session.session_id,
                reason=session.end_reason,
                bytes_to_guest=session.to_guest.total,
                bytes_from_guest=session.from_guest.total,
            )
            await uow.commit()
        log.info(
            "terminal_ended",
            allocation_id=str(session.allocation_id),
            session_id=str(session.session_id),
            reason=session.end_reason,
            bytes_to_guest=session.to_guest.total,
            bytes_from_guest=session.from_guest.total,
        )

    # --- the host's side ----------------------------------------------------------------------------

    def _held(self, session_id: uuid.UUID, node_id: str) -> Session | None:
        """The session, when this replica holds it and it belongs to the asking host (the subject's node, which
        the server vouches for): a host cannot read or feed another host's session."""
        session = self.sessions.get(session_id)
        if session is None or session.node_id != node_id:
            return None
        return session

    def _ended_here(self, session_id: uuid.UUID, node_id: str) -> bool:
        return self._ended.get(session_id) == node_id

    async def on_output(self, req: m.NodeTerminalOutput) -> m.TerminalOutputAck | None:
        """None: not this replica's session (another replica, or none, answers)."""
        session = self._held(req.session_id, req.node_id)
        if session is None:
            if self._ended_here(req.session_id, req.node_id):
                return m.TerminalOutputAck(session_id=req.session_id, status="closed", received=req.offset)
            return None
        session.agent_seen.set()
        try:
            fresh = session.from_guest.take(req.offset, base64.b64decode(req.data))
        except ValueError as exc:
            log.warning("terminal_output_gap", session_id=str(req.session_id), error=str(exc))
            await self.close(session, "agent_gone", str(exc))
            return m.TerminalOutputAck(session_id=req.session_id, status="closed", received=session.from_guest.total)
        if fresh:
            session.output.put_nowait(fresh)
        if req.eof:
            await self.close(session, req.reason or "guest_closed", req.detail)
        status = "closed" if session.closed else "open"
        return m.TerminalOutputAck(session_id=req.session_id, status=status, received=session.from_guest.total)

    async def on_input(self, req: m.NodeTerminalInput) -> m.TerminalInput | None:
        session = self._held(req.session_id, req.node_id)
        if session is None:
            if self._ended_here(req.session_id, req.node_id):
                return m.TerminalInput(session_id=req.session_id, status="closed", offset=req.received)
            return None
        session.agent_seen.set()
        # Held until the tenant types, the session ends or the hold passes: the host asks again at once.
        if not session.closed and session.to_guest.total <= req.received:
            session.input_ready.clear()
            try:
                await asyncio.wait_for(session.input_ready.wait(), self.input_hold_s)
            except TimeoutError:
                pass
        try:
            offset, data = session.to_guest.since(req.received, INPUT_CHUNK)
        except ValueError as exc:
            log.warning("terminal_input_gap", session_id=str(req.session_id), error=str(exc))
            await self.close(session, "agent_gone", str(exc))
            offset, data = session.to_guest.total, b""
        status = "closed" if session.closed and offset + len(data) >= session.to_guest.total else "open"
        return m.TerminalInput(
            session_id=req.session_id, status=status, offset=offset, data=base64.b64encode(data).decode()
        )
