"""The slice terminal on the control plane: a tenant's websocket on one side, the host's agent on the other.

Opening is one unit of work: the allocation locked and checked (the tenant's own, a slice, active, no other live
session on it, the tenant under its cap), the audit row written with this replica's claim and the
`slice.terminal_open` task queued to the host, together. The bytes then travel as the host asks for them
(node-agent's terminal: `node.terminal_output` / `node.terminal_input` requests on the host's own subjects). Only
a replica holding a session on a host listens to that host's terminal subjects (`NodeInterest`), so a request
reaches the replica holding the session's websocket, and no other; a host with no live session reaches none.

Every buffer is bounded. The guest's output: at most `output_buffer` bytes held for the websocket, and the host's
ack held until the websocket has taken them, so the host (one chunk outstanding) paces on the tenant's read. The
tenant's input: at most `input_window` bytes the host has not confirmed; a frame past it is refused whole. The
answers in flight: at most `node_answers` per host; a request past it is dropped before any task exists.
Ending completes the audit row once, with the bytes each way and why it ended.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol

from gpuaas_common.contract import TaskType, derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.metrics import Family, Sample

from ..domain.terminal import InputWindowFull, Stream, TerminalRefusal, session_refusal, terminal_refusal
from .ports import UnitOfWorkFactory

log = get_logger(__name__)

# A chunk of tenant input per answer: the host's payload limit bounds it, like the output's.
INPUT_CHUNK = m.TERMINAL_CHUNK_MAX
ENDED_KEPT = 1024

SESSIONS = Family("gpuaas_terminal_sessions", "Terminal sessions whose websocket this replica holds")
ANSWERING = Family("gpuaas_terminal_answering", "Host terminal requests this replica is answering now")
BUFFERED = Family(
    "gpuaas_terminal_buffered_bytes",
    "Terminal bytes this replica holds: guest output not yet on a websocket, "
    "tenant input not yet confirmed by its host",
)
DROPPED = Family(
    "gpuaas_terminal_dropped",
    "Host terminal requests dropped unanswered, and tenant frames refused, by why",
    ("why",),
    counter=True,
)
DROP_REASONS = ("invalid", "unknown_session", "node_busy", "output_unpaced", "input_window")


@dataclass(frozen=True)
class TerminalLimits:
    """The bounds of every buffer and queue of the terminal path (settings.py names each)."""

    output_buffer: int = 64 * 1024
    # Below the agent's wait for an output ack (10 s): an ack not given by then is not given at all, and the host
    # sends the same chunk again (counted once).
    output_ack_wait_s: float = 8.0
    input_window: int = 256 * 1024
    per_tenant: int = 4
    node_answers: int = 16
    claim_stale_s: float = 90.0


class NodeInterest(Protocol):
    """Where this replica listens for a host's terminal requests: held for each live session on the host."""

    async def hold(self, node_id: str) -> None: ...

    def let_go(self, node_id: str) -> None: ...


class _Everywhere:
    """No listening to manage (the unit tests drive the hub directly)."""

    async def hold(self, node_id: str) -> None:
        return None

    def let_go(self, node_id: str) -> None:
        return None


class ThrottledLog:
    """At most one line per `window_s` for a kind of drop, with how many there were since the last line: a host
    that floods gets counted, never a line per message."""

    def __init__(self, event: str, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.event, self.window_s, self.clock = event, window_s, clock
        self._last: dict[str, float] = {}
        self._since: Counter[str] = Counter()

    def note(self, why: str, **fields: Any) -> bool:
        """Whether a line was written."""
        self._since[why] += 1
        now = self.clock()
        if now - self._last.get(why, -self.window_s) < self.window_s:
            return False
        self._last[why] = now
        log.warning(self.event, why=why, dropped_since_last=self._since.pop(why), **fields)
        return True


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
    # Bytes from the guest not yet handed to the websocket (at most TerminalLimits.output_buffer of them, counted
    # in `queued`), and a wake-up for each side; `drained` is set while nothing is queued.
    output: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    queued: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    input_ready: asyncio.Event = field(default_factory=asyncio.Event)
    agent_seen: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    end_reason: str | None = None
    end_detail: str | None = None

    def __post_init__(self) -> None:
        self.drained.set()

    def written(self, n: int) -> None:
        """The websocket took `n` queued bytes (its send returned: they are in the socket, not held by us)."""
        self.queued -= n
        if self.queued <= 0:
            self.queued = 0
            self.drained.set()


class TerminalHub:
    """This replica's open sessions and the answers to their hosts' requests."""

    def __init__(
        self,
        unit_of_work: UnitOfWorkFactory,
        *,
        session_max_s: float,
        input_hold_s: float,
        limits: TerminalLimits | None = None,
        interest: NodeInterest | None = None,
        replica_id: str | None = None,
    ) -> None:
        self._uow = unit_of_work
        self.session_max_s = session_max_s
        self.input_hold_s = input_hold_s
        self.limits = limits or TerminalLimits()
        self.interest: NodeInterest = interest or _Everywhere()
        # This process's name in the audit rows' claims (no two replicas share one).
        self.replica_id = replica_id or uuid.uuid4().hex[:16]
        self.sessions: dict[uuid.UUID, Session] = {}
        # Sessions this replica ended lately, by host: a host still relaying one hears `closed` instead of silence.
        self._ended: OrderedDict[uuid.UUID, str] = OrderedDict()
        # Answers in flight, by host; never more than limits.node_answers for one.
        self.answering: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self._drop_log = ThrottledLog("terminal_request_dropped")

    # --- the tenant's side ------------------------------------------------------------------------------

    async def open(
        self, allocation_id: uuid.UUID, tenant_id: str, actor: str, *, cols: int = 80, rows: int = 24
    ) -> Session:
        """Refused (nothing stored, nothing sent) unless the allocation is the tenant's active slice."""
        session_id = uuid.uuid4()
        task_id = f"terminal-{session_id}"
        async with self._uow() as uow:
            sessions = uow.repos.terminal
            row = await sessions.lock_allocation(allocation_id)
            refusal = terminal_refusal(row, allocation_id, tenant_id)
            if refusal is not None:
                log.info("terminal_refused", allocation_id=str(allocation_id), code=refusal.code, actor=actor)
                raise Refused(refusal)
            assert row is not None
            node_id = row["node_id"]
            await sessions.lock_tenant(tenant_id)
            await sessions.end_stale_sessions(tenant_id, self.limits.claim_stale_s)
            here, of_tenant = await sessions.live_counts(tenant_id, allocation_id)
            refusal = session_refusal(here, of_tenant, self.limits.per_tenant)
            if refusal is not None:
                log.info("terminal_refused", allocation_id=str(allocation_id), code=refusal.code, actor=actor)
                raise Refused(refusal)
            await sessions.insert_session(
                session_id=session_id,
                allocation_id=allocation_id,
                tenant_id=tenant_id,
                actor=actor,
                node_id=node_id,
                task_id=task_id,
                replica_id=self.replica_id,
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
                TaskType.SLICE_TERMINAL_OPEN,
                task,
                aggregate_id=str(allocation_id),
                event_id=derived_event_id(task_id, "open"),
                node_id=node_id,
            )
            session = Session(session_id, allocation_id, node_id)
            # Before the commit: the host may ask as soon as the task is out, and must find this replica listening.
            await self.interest.hold(node_id)
            self.sessions[session_id] = session
            try:
                await uow.commit()
            except BaseException:
                self.sessions.pop(session_id, None)
                self.interest.let_go(node_id)
                raise
        log.info(
            "terminal_opened",
            allocation_id=str(allocation_id),
            session_id=str(session_id),
            node_id=node_id,
            actor=actor,
        )
        return session

    def type(self, session: Session, data: bytes) -> bool:
        """Keep the tenant's bytes for the host; False (nothing kept) when they would pass the input window."""
        if session.closed or not data:
            return True
        try:
            session.to_guest.put(data, self.limits.input_window)
        except InputWindowFull:
            self.dropped["input_window"] += 1
            return False
        session.input_ready.set()
        return True

    async def close(self, session: Session, reason: str, detail: str | None = None) -> None:
        """End the session (once): the host hears `closed` at its next request, the audit row is completed."""
        if session.end_reason is None:
            session.end_reason, session.end_detail = reason, detail
        session.closed = True
        session.input_ready.set()
        session.drained.set()  # an ack held for the websocket goes out now, saying `closed`
        session.output.put_nowait(None)
        if self.sessions.pop(session.session_id, None) is None:
            return
        self.interest.let_go(session.node_id)
        self._ended[session.session_id] = session.node_id
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        async with self._uow() as uow:
            await uow.repos.terminal.end_session(
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

    async def renew_claims(self) -> None:
        """Tell the other replicas this one still holds its sessions (their audit rows' `seen_at`)."""
        if not self.sessions:
            return
        async with self._uow() as uow:
            await uow.repos.terminal.renew_claims(list(self.sessions))
            await uow.commit()

    # --- the host's side ----------------------------------------------------------------------------

    def answers_for(self, session_id: uuid.UUID, node_id: str) -> bool:
        """Whether a request for this session from this host is this replica's to answer: one it holds, or one
        it ended lately (the host hears `closed`). Anything else is dropped before a task exists for it."""
        return self._held(session_id, node_id) is not None or self._ended_here(session_id, node_id)

    def admit(self, node_id: str) -> bool:
        """Take one of the host's answer slots; False when all are in use (the request is dropped, counted).
        Never waits: a waiting request would be the unbounded backlog again. `done` gives the slot back."""
        if self.answering[node_id] >= self.limits.node_answers:
            return False
        self.answering[node_id] += 1
        return True

    def done(self, node_id: str) -> None:
        self.answering[node_id] -= 1
        if self.answering[node_id] <= 0:
            del self.answering[node_id]

    def drop(self, why: str, **fields: Any) -> None:
        self.dropped[why] += 1
        self._drop_log.note(why, **fields)

    def buffered_bytes(self) -> int:
        return sum(s.queued + s.to_guest.held for s in self.sessions.values())

    async def reading(self) -> list[Sample]:
        """/metrics: this replica's sessions, answers in flight, bytes held and drops."""
        out = [
            SESSIONS(value=len(self.sessions)),
            ANSWERING(value=sum(self.answering.values())),
            BUFFERED(value=self.buffered_bytes()),
        ]
        return out + [DROPPED(why, value=self.dropped[why]) for why in DROP_REASONS]

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
        data = base64.b64decode(req.data)
        # Only what was not taken before counts (a chunk sent again after an unanswered ask adds nothing).
        if session.queued + max(0, req.offset + len(data) - session.from_guest.total) > self.limits.output_buffer:
            # A host that did not wait for its last ack (ours is held until the websocket took the bytes): not
            # taken, not answered; an honest host never gets here, and sends the chunk again when it does wait.
            self.drop("output_unpaced", node_id=req.node_id, session_id=str(req.session_id))
            return None
        try:
            fresh = session.from_guest.take(req.offset, data)
        except ValueError as exc:
            log.warning("terminal_output_gap", session_id=str(req.session_id), error=str(exc))
            await self.close(session, "agent_gone", str(exc))
            return m.TerminalOutputAck(session_id=req.session_id, status="closed", received=session.from_guest.total)
        if fresh and not session.closed:
            session.queued += len(fresh)
            session.drained.clear()
            session.output.put_nowait(fresh)
        if req.eof:
            await self.close(session, req.reason or "guest_closed", req.detail)
        elif not session.closed and session.queued:
            # The ack waits for the tenant's read: the host sends its next chunk only after it, so a websocket
            # that never reads holds at most one buffer of the guest's output here.
            try:
                await asyncio.wait_for(session.drained.wait(), self.limits.output_ack_wait_s)
            except TimeoutError:
                return None  # unanswered: the host sends the same chunk again, which is counted once
        status: Literal["open", "closed"] = "closed" if session.closed else "open"
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
        status: Literal["open", "closed"] = (
            "closed" if session.closed and offset + len(data) >= session.to_guest.total else "open"
        )
        return m.TerminalInput(
            session_id=req.session_id, status=status, offset=offset, data=base64.b64encode(data).decode()
        )
