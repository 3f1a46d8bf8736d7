"""The slice terminal's rules in the allocator: who may open one, and the byte streams' offsets that make a lost
answer harmless and a forged one useless."""

from __future__ import annotations

import base64
import uuid

import pytest

from gpuaas_allocator.domain.terminal import Stream, terminal_refusal
from gpuaas_allocator.service_layer.terminal import Session, TerminalHub
from gpuaas_common.contract import messages as m

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
