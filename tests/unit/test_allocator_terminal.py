"""The slice terminal's rules in the allocator: who may open one, and the byte streams' offsets that make a lost
answer harmless and a forged one useless."""

from __future__ import annotations

import asyncio
import base64
import uuid

import pytest

from gpuaas_allocator.domain.portal_assertion import AssertionRefused, TenantAssertion, sign, verify
from gpuaas_allocator.domain.terminal import Stream, session_refusal, terminal_refusal
from gpuaas_allocator.entrypoints.main import terminal_intake
from gpuaas_allocator.service_layer.terminal import Session, TerminalHub, TerminalLimits
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_dev.testing.waiting import eventually

ALLOC = uuid.uuid4()


def _row(**over: object) -> dict[str, object]:
    return {"tenant_id": "t1", "shape": "gpu_slice", "state": "active", "node_id": "n1", **over}


def test_only_the_tenants_own_active_slice_opens_a_terminal() -> None:
    assert terminal_refusal(_row(), ALLOC, "t1") is None
    theirs = terminal_refusal(_row(), ALLOC, "t2")
    unknown = terminal_refusal(None, ALLOC, "t2")
    # Another tenant's allocation reads exactly as one that does not exist.
    assert theirs is not None and unknown is not None
    assert (theirs.status, theirs.code, theirs.reason) == (unknown.status, unknown.code, unknown.reason)
    for state in ("accepted", "provisioning", "releasing", "released", "failed"):
        refusal = terminal_refusal(_row(state=state), ALLOC, "t1")
        assert refusal is not None and (refusal.status, refusal.code) == (409, "allocation_not_active")
        assert state in refusal.reason
    bm = terminal_refusal(_row(shape="baremetal"), ALLOC, "t1")
    assert bm is not None and bm.code == "not_a_slice"


def test_a_resent_chunk_is_counted_once_and_a_gap_is_refused() -> None:
    s = Stream()
    assert s.take(0, b"hello ") == b"hello "
    assert s.take(0, b"hello ") == b""  # the answer to the first send was lost; the host sent it again
    assert s.take(3, b"lo world") == b"world"
    assert s.total == 11
    with pytest.raises(ValueError, match="gap"):
        s.take(20, b"x")


def test_input_is_kept_until_the_host_says_it_has_it() -> None:
    s = Stream()
    s.put(b"ls\n")
    assert s.since(0, 100) == (0, b"ls\n")
    assert s.since(0, 100) == (0, b"ls\n")  # asked again: the answer was lost
    s.put(b"pwd\n")
    assert s.since(3, 2) == (3, b"pw")
    assert s.since(5, 100) == (5, b"d\n")
    with pytest.raises(ValueError):
        s.since(1, 100)  # behind what it already confirmed: not a host that is following


async def test_a_host_cannot_read_or_feed_another_hosts_session() -> None:
    hub = TerminalHub(lambda: None, session_max_s=60, input_hold_s=0.01)  # type: ignore[arg-type,return-value]
    session = Session(uuid.uuid4(), ALLOC, "n1")
    hub.sessions[session.session_id] = session
    hub.type(session, b"secret\n")
    out = m.NodeTerminalOutput(
        session_id=session.session_id, node_id="n2", offset=0, data=base64.b64encode(b"x").decode()
    )
    assert await hub.on_output(out) is None
    assert await hub.on_input(m.NodeTerminalInput(session_id=session.session_id, node_id="n2", received=0)) is None
    assert session.from_guest.total == 0 and session.output.empty() and not session.agent_seen.is_set()
    mine = await hub.on_input(m.NodeTerminalInput(session_id=session.session_id, node_id="n1", received=0))
    assert mine is not None and base64.b64decode(mine.data) == b"secret\n" and mine.status == "open"


# --- issue 38: bounded buffers, parse before allocating, the portal's signed word (review 3, N3, N7, N8) -------


def _hub(**limits: object) -> TerminalHub:
    return TerminalHub(
        lambda: None,  # type: ignore[arg-type,return-value]
        session_max_s=60,
        input_hold_s=0.01,
        limits=TerminalLimits(**limits),  # type: ignore[arg-type]
    )


def _held(hub: TerminalHub, node: str = "n1") -> Session:
    session = Session(uuid.uuid4(), ALLOC, node)
    hub.sessions[session.session_id] = session
    return session


def _chunk(session: Session, offset: int, size: int) -> m.NodeTerminalOutput:
    data = base64.b64encode(b"o" * size).decode()
    return m.NodeTerminalOutput(session_id=session.session_id, node_id=session.node_id, offset=offset, data=data)


def test_input_past_the_window_is_refused_whole_and_nothing_of_it_kept() -> None:
    """N7: the tenant's input was appended without a cap (256 MiB held in the review's snippet)."""
    hub = _hub(input_window=64 * 1024)
    session = _held(hub)
    assert hub.type(session, b"x" * 60 * 1024) is True
    assert hub.type(session, b"y" * 8 * 1024) is False  # would pass the window: refused whole
    assert session.to_guest.held == 60 * 1024 and session.to_guest.total == 60 * 1024
    assert hub.dropped["input_window"] == 1
    # The host confirms what it wrote: the window opens again.
    session.to_guest.since(60 * 1024, 0)
    assert hub.type(session, b"y" * 8 * 1024) is True


async def test_a_websocket_that_never_reads_keeps_the_buffered_output_under_one_buffer() -> None:
    """N7: the guest's output was acknowledged as soon as it was queued, the queue unbounded, so a tenant that
    stopped reading grew the allocator without bound. Now the ack waits for the websocket; a host that does not
    wait for it is not taken."""
    hub = _hub(output_buffer=32 * 1024, output_ack_wait_s=0.05)
    session = _held(hub)
    chunk = m.TERMINAL_CHUNK_MAX
    # Nobody reads the websocket: the first chunk is queued and its ack never given.
    assert await hub.on_output(_chunk(session, 0, chunk)) is None
    # The host sends it again (same offset): counted once, still unanswered.
    assert await hub.on_output(_chunk(session, 0, chunk)) is None
    # A host that does not wait: every later chunk is refused while one buffer is held.
    for i in range(1, 64):
        assert await hub.on_output(_chunk(session, i * chunk, chunk)) in (None,)
    assert session.from_guest.total <= 32 * 1024
    assert hub.buffered_bytes() <= 32 * 1024
    assert hub.dropped["output_unpaced"] > 0
    # The websocket reads again (what entrypoints/terminal_http does with each chunk): the next ack is given once
    # its bytes were taken.

    async def reader() -> None:
        while (chunk := await session.output.get()) is not None:
            session.written(len(chunk))

    reading = asyncio.create_task(reader())
    await session.drained.wait()
    ack = await hub.on_output(_chunk(session, session.from_guest.total, 100))
    assert ack is not None and ack.status == "open" and ack.received == session.from_guest.total
    assert session.queued == 0
    session.output.put_nowait(None)
    await reading


class _Msg:
    """What nats-py hands a subscription callback: a subject, a body, a reply subject and respond()."""

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data, self.reply = subject, data, "_INBOX_node-n1.x"
        self.answers: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(data)


def _ask(node: str, session_id: uuid.UUID) -> _Msg:
    ask = m.NodeTerminalInput(session_id=session_id, node_id=node, received=0)
    env = Envelope.wrap("node.terminal_input", ask.model_dump(mode="json"), producer="node-agent", correlation_id="c")
    return _Msg(f"gpuaas.node.{node}.terminal.input", env.model_dump_json().encode())


async def test_a_host_flooding_terminal_input_creates_no_task_for_unknown_sessions_and_a_bounded_few_for_its_own() -> (
    None
):
    """N3: a task was spawned for every message before it was parsed, so one host's loop grew every replica's
    tasks without bound. Now unknown sessions and garbage are dropped in the callback, and a host's own
    session gets at most `node_answers` answers in flight."""
    hub = _hub(node_answers=4)
    hub.input_hold_s = 30.0  # every ask of the held session waits: the worst case for tasks
    session = _held(hub)
    intake = terminal_intake(hub, "node.terminal_input", hub.on_input)
    before = len(asyncio.all_tasks())
    for _ in range(2000):
        await intake(_ask("n1", uuid.uuid4()))  # sessions nobody holds
        await intake(_Msg("gpuaas.node.n1.terminal.input", b"x"))  # not even a message
    assert len(asyncio.all_tasks()) == before
    assert hub.dropped["unknown_session"] == 2000 and hub.dropped["invalid"] == 2000
    for _ in range(2000):
        await intake(_ask("n1", session.session_id))
    # The admitted answers started: the first one marks the session seen by its host before it holds.
    await asyncio.wait_for(session.agent_seen.wait(), 5)
    answers = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("._answer")]  # type: ignore[union-attr]
    assert len(answers) == 4 and sum(hub.answering.values()) == 4
    assert len(asyncio.all_tasks()) - before <= 2 * 4  # each answer, and the hold's wait_for inside it
    assert hub.dropped["node_busy"] == 1996
    # Another host's requests for this session are not this replica's to answer either.
    await intake(_ask("n2", session.session_id))
    assert hub.dropped["unknown_session"] == 2001
    hub.type(session, b"ls\n")  # the tenant types: the held asks are answered, the slots given back
    await eventually(lambda: not hub.answering, timeout=5, what="the held answers' slots given back")


def test_a_portal_assertion_opens_only_its_tenant_and_only_signed_and_unexpired() -> None:
    """N8: the portal token plus any X-Tenant-Id opened any tenant's console. Now the tenant is the one the
    portal signed, with the person, until it expires."""
    key, now = b"k" * 32, 1_000_000.0
    token = sign(key, TenantAssertion("tenant-a", "alice", int(now) + 60))
    assert verify(key, token, now) == TenantAssertion("tenant-a", "alice", int(now) + 60)
    head, body, mac = token.split(".")
    forged_claims = base64.urlsafe_b64encode(b'{"exp":1000060,"tenant_id":"tenant-b","user_id":"alice"}')
    for bad, why in (
        (sign(b"x" * 32, TenantAssertion("tenant-a", "alice", int(now) + 60)), "not signed"),
        (f"{head}.{forged_claims.decode().rstrip('=')}.{mac}", "not signed"),
        (sign(key, TenantAssertion("tenant-a", "alice", int(now) - 1)), "expired"),
        (sign(key, TenantAssertion("tenant-a", "alice", int(now) + 86400)), "longer"),
        ("portal-token", "not a portal tenant assertion"),
        (f"{head}.{body}.", "not signed"),
    ):
        with pytest.raises(AssertionRefused, match=why):
            verify(key, bad, now)


def test_a_second_session_on_an_allocation_and_past_the_tenants_cap_is_refused() -> None:
    assert session_refusal(0, 3, 4) is None
    busy = session_refusal(1, 1, 4)
    assert busy is not None and (busy.status, busy.code) == (409, "terminal_in_use")
    full = session_refusal(0, 4, 4)
    assert full is not None and (full.status, full.code) == (429, "too_many_terminals")
