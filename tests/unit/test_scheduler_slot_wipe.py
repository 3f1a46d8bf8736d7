"""The wipe rule of domain/slot_wipe.py, table-driven (issue 38, point 1): when approval owes a slot its host's
wipe proof, what a host's return from maintenance owes each of its slots, which slots a lost ask is asked again
for, and what a host's outcome makes of the slot."""

from __future__ import annotations

import pytest

from gpuaas_scheduler.domain.slot_wipe import (
    AWAITING_WIPE,
    WIPE_OWED_RULES,
    DiskFacts,
    ReturnFacts,
    approval_status,
    judge_wipe,
    reasked_when_overdue,
    wipe_on_return,
    wipe_owed,
)
from gpuaas_scheduler.domain.slots import SLOT_STATUSES, check_slot_transition

DISK = "/dev/disk/by-id/nvme-eui.0001"
OTHER = "/dev/disk/by-id/nvme-eui.0002"


@pytest.mark.parametrize(
    ("facts", "owed"),
    [
        # A first approval on a slice host: the disk evidence (no signatures) is the approval rules' business.
        (DiskFacts("slice", None, None, DISK), []),
        (DiskFacts("slice", "available", DISK, DISK), []),
        (DiskFacts("slice", "disabled", DISK, DISK), []),
        (DiskFacts("drained", "disabled", DISK, DISK), []),
        # Someone else's data may be there.
        (DiskFacts("converting", None, None, DISK), ["host_converting"]),
        (DiskFacts("converting", "retired", DISK, DISK), ["host_converting", "slot_retired"]),
        (DiskFacts("slice", "retired", DISK, DISK), ["slot_retired"]),
        (DiskFacts("slice", AWAITING_WIPE, DISK, DISK), ["wipe_still_owed"]),
        (DiskFacts("slice", "disabled", DISK, DISK, wipe_open=True), ["wipe_still_owed"]),
        (DiskFacts("slice", "available", DISK, OTHER), ["disk_changed"]),
    ],
)
def test_when_a_wipe_is_owed(facts, owed):
    why = {r.why: r.name for r in WIPE_OWED_RULES}
    assert [why[w] for w in wipe_owed(facts)] == owed


def test_approval_never_makes_a_slot_that_owes_a_wipe_available():
    assert approval_status([], []) == ("available", None)
    status, reason = approval_status([], ["the host is converting"])
    assert status == AWAITING_WIPE and "wipe proof" in reason
    assert approval_status(["missing MAC"], ["the host is converting"])[0] == "disabled"


def _slot(status=AWAITING_WIPE, policy="blkdiscard"):
    return {"status": status, "nvme_by_id": DISK, "destructive_wipe_policy": policy}


def _proof(method="blkdiscard", verified=True, signatures=(), device=DISK):
    return {"device": device, "method": method, "verified": verified, "signatures": list(signatures)}


@pytest.mark.parametrize(
    ("slot", "outcome", "problems", "passed", "to"),
    [
        (_slot(), {"device": DISK, "proof": _proof()}, [], True, "available"),
        (_slot("cleanup_blocked"), {"device": DISK, "proof": _proof()}, [], True, "available"),
        # Proven, but the slot is not one a proof frees, or fails its binding: left where it is.
        (_slot("disabled"), {"device": DISK, "proof": _proof()}, [], True, None),
        (_slot(), {"device": DISK, "proof": _proof()}, ["a live claim holds the slot"], True, None),
        # Not proven: an awaiting slot is blocked, a blocked one stays blocked.
        (_slot(), {"device": DISK, "proof": _proof(verified=False)}, [], False, "cleanup_blocked"),
        (_slot(), {"device": DISK, "proof": _proof(signatures=["ext4"])}, [], False, "cleanup_blocked"),
        (_slot(policy="crypto_erase"), {"device": DISK, "proof": _proof()}, [], False, "cleanup_blocked"),
        (_slot(), {"device": DISK, "proof": None, "reason_code": "disk_leased"}, [], False, "cleanup_blocked"),
        (_slot(), {"device": OTHER, "proof": _proof(device=OTHER)}, [], False, "cleanup_blocked"),
        (_slot("cleanup_blocked"), {"device": DISK, "proof": _proof(verified=False)}, [], False, None),
    ],
)
def test_what_a_hosts_outcome_makes_of_the_slot(slot, outcome, problems, passed, to):
    judged = judge_wipe(slot, DISK, outcome, problems)
    assert (judged.passed, judged.to) == (passed, to), judged.verdict


@pytest.mark.parametrize(
    ("facts", "rule", "ask", "to"),
    [
        # Free: placeable no more until the host proves the wipe of the disk it has now.
        (ReturnFacts("available", claimed=False), "available", True, AWAITING_WIPE),
        (ReturnFacts("available", claimed=False, wipe_open=True), "available", True, AWAITING_WIPE),
        # Not placeable anyway: asked where it is, so a later repair or report finds the proof owed.
        (ReturnFacts("disabled", claimed=False), "disabled", True, None),
        (ReturnFacts(AWAITING_WIPE, claimed=False, wipe_open=True), "awaiting_wipe", True, None),
        (ReturnFacts(AWAITING_WIPE, claimed=False), "awaiting_wipe", True, None),
        (ReturnFacts("cleanup_blocked", claimed=False, wipe_open=True), "blocked_wipe_open", True, None),
        # Its repair asks; an operator decides when.
        (ReturnFacts("cleanup_blocked", claimed=False), "blocked", False, None),
        (ReturnFacts("retired", claimed=False), "retired", False, None),
        # Under a claim: the release's cleanup proves the wipe; a claim on an available row counts as in use.
        *[(ReturnFacts(st, claimed=True), "in_use", False, None) for st in ("reserved", "active", "cleanup")],
        (ReturnFacts("provisioning", claimed=False), "in_use", False, None),
        (ReturnFacts("releasing", claimed=False), "in_use", False, None),
        (ReturnFacts("available", claimed=True), "in_use", False, None),
    ],
)
def test_what_a_return_from_maintenance_owes_each_slot(facts, rule, ask, to):
    decision = wipe_on_return(facts)
    assert (decision.rule, decision.ask, decision.to) == (rule, ask, to)


@pytest.mark.parametrize("status", SLOT_STATUSES)
@pytest.mark.parametrize("claimed", [False, True])
def test_every_slot_status_has_a_return_rule_and_its_move_is_legal(status, claimed):
    decision = wipe_on_return(ReturnFacts(status, claimed))
    assert decision.rule != "none", status
    if decision.to is not None:
        check_slot_transition(status, decision.to)
    # No slot leaves maintenance placeable without a wipe asked, unless a claim or a later repair covers it.
    assert decision.to != "available"


@pytest.mark.parametrize(
    ("status", "claimed", "reasked"),
    [
        # Nothing but the host's proof moves these: a lost ask is asked again.
        (AWAITING_WIPE, False, True),
        ("disabled", False, True),
        # A repair asks again; a claim's release is what wipes the disk; a free slot owes nothing.
        ("cleanup_blocked", False, False),
        ("available", False, False),
        ("retired", False, False),
        (AWAITING_WIPE, True, False),
        ("releasing", True, False),
    ],
)
def test_which_slots_a_lost_wipe_ask_is_asked_again_for(status, claimed, reasked):
    assert reasked_when_overdue(status, claimed) is reasked
