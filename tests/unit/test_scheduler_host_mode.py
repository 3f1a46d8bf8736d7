"""The host-mode transition table (scheduler domain): every allowed transition with its guards met,
every refused pair, each guard failing on its own, and what a change records."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from itertools import product

import pytest

from gpuaas_scheduler.domain.host_mode import (
    BAREMETAL,
    CONVERTING,
    DRAINED,
    MODES,
    RETIRED,
    SLICE,
    TRANSITIONS,
    Host,
    HostFacts,
    ModeRefused,
    allowed_targets,
    transition_problems,
)

AT = datetime(2026, 4, 17, 12, 0, tzinfo=timezone.utc)

# Facts under which every guard of a transition holds. Entering slice needs re-approved (so unretired)
# slots, every other transition needs all slots retired: hence two sets.
READY_FOR_SLICE = HostFacts(
    "h1",
    SLICE,
    accepts_slices=True,
    accepts_baremetal=True,
    live_claims=0,
    unretired_slots=8,
    parity_failures=0,
    rediscovered=True,
    reapproved_slots=8,
    stale_slots=0,
)
EMPTY = HostFacts(
    "h1", SLICE, accepts_slices=True, accepts_baremetal=True, live_claims=0, unretired_slots=0, parity_failures=None
)


def ready(frm: str, to: str) -> HostFacts:
    return replace(READY_FOR_SLICE if to == SLICE else EMPTY, mode=frm)


EXPECTED_TABLE = {
    (SLICE, DRAINED),
    (DRAINED, SLICE),
    (DRAINED, BAREMETAL),
    (DRAINED, CONVERTING),
    (DRAINED, RETIRED),
    (BAREMETAL, CONVERTING),
    (BAREMETAL, RETIRED),
    (CONVERTING, SLICE),
    (CONVERTING, BAREMETAL),
    (CONVERTING, RETIRED),
    (RETIRED, CONVERTING),
    (RETIRED, BAREMETAL),
}


def test_the_table_is_the_documented_one():
    # A new edge is a product decision: it must show up here, with its guards tested below.
    assert set(TRANSITIONS) == EXPECTED_TABLE
    assert set(MODES) == {SLICE, BAREMETAL, CONVERTING, DRAINED, RETIRED}


@pytest.mark.parametrize("frm,to", sorted(EXPECTED_TABLE))
def test_every_allowed_transition_records_who_why_when(frm, to):
    host = Host(ready(frm, to))
    change = host.change_mode(to, actor="ops@site", reason="ticket 42", at=AT)
    assert (change.from_mode, change.to_mode, change.actor, change.reason, change.at) == (
        frm,
        to,
        "ops@site",
        "ticket 42",
        AT,
    )
    assert host.mode == to and host.changes == [change]
    # Entering converting, and only that, puts parity and topology back to unknown.
    assert change.resets_evidence == (to == CONVERTING)
    if to == CONVERTING:
        assert host.facts.parity_failures is None and not host.facts.rediscovered
        assert host.facts.reapproved_slots == 0


REFUSED = sorted(set(product(MODES, MODES)) - EXPECTED_TABLE)


@pytest.mark.parametrize("frm,to", REFUSED)
def test_every_other_pair_is_refused_and_changes_nothing(frm, to):
    facts = ready(frm, to)
    host = Host(facts)
    with pytest.raises(ModeRefused) as exc:
        host.change_mode(to, actor="ops", reason="try", at=AT)
    assert exc.value.current == frm and exc.value.target == to and exc.value.problems
    assert host.facts == facts and host.changes == []
    if frm == to:
        assert exc.value.problems == [f"the host is already {to}"]
    else:
        assert exc.value.problems[0].startswith(f"{frm} → {to} is not a transition")


def test_slice_to_baremetal_points_at_the_drain():
    problems = transition_problems(ready(SLICE, BAREMETAL), BAREMETAL)
    assert len(problems) == 1 and "drain it first" in problems[0] and "(from slice: drained)" in problems[0]


def test_a_host_back_from_baremetal_cannot_skip_conversion():
    problems = transition_problems(ready(BAREMETAL, SLICE), SLICE)
    assert "goes through converting" in problems[0]


# (from, to, the one fact that breaks, a word of the guard's message)
GUARD_FAILURES = [
    (DRAINED, BAREMETAL, {"live_claims": 2}, "2 live claim(s)"),
    (DRAINED, BAREMETAL, {"unretired_slots": 1}, "1 approved slot(s) not retired"),
    (DRAINED, BAREMETAL, {"accepts_baremetal": False}, "gpuaas-profile-baremetal"),
    (DRAINED, SLICE, {"parity_failures": None}, "no parity run"),
    (DRAINED, SLICE, {"parity_failures": 3}, "3 failure(s)"),
    (DRAINED, SLICE, {"accepts_slices": False}, "gpuaas-profile-slice-vm"),
    (DRAINED, CONVERTING, {"live_claims": 1}, "live claim"),
    (DRAINED, CONVERTING, {"unretired_slots": 8}, "not retired"),
    (DRAINED, CONVERTING, {"accepts_slices": False}, "gpuaas-profile-slice-vm"),
    (DRAINED, RETIRED, {"live_claims": 1}, "live claim"),
    (DRAINED, RETIRED, {"unretired_slots": 1}, "not retired"),
    (BAREMETAL, CONVERTING, {"live_claims": 1}, "live claim"),
    (BAREMETAL, CONVERTING, {"unretired_slots": 1}, "not retired"),
    (BAREMETAL, CONVERTING, {"accepts_slices": False}, "gpuaas-profile-slice-vm"),
    (BAREMETAL, RETIRED, {"live_claims": 1}, "live claim"),
    (CONVERTING, SLICE, {"rediscovered": False}, "no topology report"),
    (CONVERTING, SLICE, {"parity_failures": None}, "no parity run"),
    (CONVERTING, SLICE, {"parity_failures": 1}, "1 failure(s)"),
    (CONVERTING, SLICE, {"reapproved_slots": 0}, "no slot re-approved"),
    (CONVERTING, SLICE, {"stale_slots": 2}, "2 slot(s) were approved before the evidence reset"),
    (CONVERTING, SLICE, {"accepts_slices": False}, "gpuaas-profile-slice-vm"),
    (CONVERTING, BAREMETAL, {"unretired_slots": 3}, "not retired"),
    (CONVERTING, BAREMETAL, {"accepts_baremetal": False}, "gpuaas-profile-baremetal"),
    (CONVERTING, RETIRED, {"unretired_slots": 1}, "not retired"),
    (RETIRED, CONVERTING, {"accepts_slices": False}, "gpuaas-profile-slice-vm"),
    (RETIRED, BAREMETAL, {"unretired_slots": 1}, "not retired"),
    (RETIRED, BAREMETAL, {"accepts_baremetal": False}, "gpuaas-profile-baremetal"),
]


@pytest.mark.parametrize("frm,to,broken,needle", GUARD_FAILURES)
def test_each_guard_refuses_on_its_own(frm, to, broken, needle):
    facts = replace(ready(frm, to), **broken)
    host = Host(facts)
    with pytest.raises(ModeRefused) as exc:
        host.change_mode(to, actor="ops", reason="try", at=AT)
    assert len(exc.value.problems) == 1 and needle in exc.value.problems[0], exc.value.problems
    assert host.facts == facts and host.changes == []


def test_every_failing_guard_is_listed_at_once():
    facts = replace(ready(DRAINED, BAREMETAL), live_claims=1, unretired_slots=8, accepts_baremetal=False)
    assert len(transition_problems(facts, BAREMETAL)) == 3


def test_slice_to_drained_is_allowed_with_live_slices_running():
    # Draining is how a host empties: its live allocations run to their natural end.
    host = Host(replace(READY_FOR_SLICE, live_claims=5))
    assert host.change_mode(DRAINED, actor="ops", reason="convert to baremetal", at=AT).to_mode == DRAINED


def test_return_from_baremetal_converts_a_slice_capable_host_and_keeps_a_baremetal_only_one():
    host = Host(replace(EMPTY, mode=BAREMETAL, parity_failures=0, rediscovered=True))
    change = host.return_from_baremetal(actor="scheduler", reason="released", at=AT, allocation_id="a-1")
    assert change is not None and (change.from_mode, change.to_mode, change.allocation_id) == (
        BAREMETAL,
        CONVERTING,
        "a-1",
    )
    assert change.resets_evidence and host.facts.parity_failures is None and not host.facts.rediscovered
    only_bm = Host(replace(EMPTY, mode=BAREMETAL, accepts_slices=False))
    assert only_bm.return_from_baremetal(actor="scheduler", reason="released", at=AT) is None
    assert only_bm.mode == BAREMETAL and only_bm.changes == []


def test_return_from_baremetal_refuses_a_host_still_holding_slots():
    host = Host(replace(EMPTY, mode=BAREMETAL, unretired_slots=1))
    with pytest.raises(ModeRefused):
        host.return_from_baremetal(actor="scheduler", reason="released", at=AT)
    assert host.mode == BAREMETAL


def test_conversion_back_to_slice_needs_all_three_steps_after_the_reset():
    host = Host(replace(EMPTY, mode=BAREMETAL))
    host.change_mode(CONVERTING, actor="scheduler", reason="released", at=AT)
    assert not host.promotable_to_slice()
    assert len(host.blockers(SLICE)) == 3  # rediscovery, parity, re-approval
    host.facts = replace(host.facts, rediscovered=True, parity_failures=0, reapproved_slots=4, unretired_slots=4)
    assert host.promotable_to_slice()
    host.change_mode(SLICE, actor="ops", reason="re-approved", at=AT)
    assert [(c.from_mode, c.to_mode) for c in host.changes] == [(BAREMETAL, CONVERTING), (CONVERTING, SLICE)]


def test_allowed_targets():
    assert allowed_targets(SLICE) == [DRAINED]
    assert set(allowed_targets(CONVERTING)) == {SLICE, BAREMETAL, RETIRED}


def test_unknown_mode():
    assert "unknown mode" in transition_problems(EMPTY, "spare")[0]
