"""The pure force-release rules (domain/force_release.py): who may still hold the devices, and where the slots go."""

from __future__ import annotations

import pytest

from gpuaas_scheduler.domain.force_release import VM_MAY_HOLD, plan_force_release
from gpuaas_scheduler.domain.slots import SLOT_STATUSES


def _slot(status: str, slot_id: str = "h1-s0") -> dict:
    return {"node_id": "h1", "slot_id": slot_id, "claim_kind": "slot", "status": status}


@pytest.mark.parametrize("status", SLOT_STATUSES)
@pytest.mark.parametrize("force", [False, True])
def test_each_slot_status(status: str, force: bool) -> None:
    plan = plan_force_release([_slot(status)], force)
    may_hold = status in {"reserved", "provisioning", "active", "releasing"}
    assert bool(plan.holders) is may_hold
    assert plan.refused is (may_hold and not force)
    # Wherever a slot goes, it is cleanup_blocked; a slot the table cannot move there is left and named.
    movable = status in {"reserved", "provisioning", "active", "releasing", "cleanup", "awaiting_wipe"}
    assert plan.block == (["h1-s0"] if movable else [])
    assert plan.untouched == ({} if movable else {"h1-s0": status})
    assert plan.drain == []


def test_the_evidence_set_is_the_lifecycle_statuses() -> None:
    assert VM_MAY_HOLD == {"reserved", "provisioning", "active", "releasing"}


def test_a_whole_node_claim_always_needs_force_and_drains_the_node() -> None:
    claim = {"node_id": "bm1", "slot_id": None, "claim_kind": "node_exclusive", "status": None}
    refused = plan_force_release([claim], force=False)
    assert refused.refused and "held whole" in refused.holders[0]
    forced = plan_force_release([claim], force=True)
    assert not forced.refused and forced.drain == ["bm1"] and forced.block == [] and forced.untouched == {}


def test_one_holder_among_many_refuses_the_whole_release() -> None:
    plan = plan_force_release([_slot("cleanup", "h1-s0"), _slot("active", "h1-s1")], force=False)
    assert plan.refused
    assert plan.holders == ["slot h1-s1 is active: the allocation's VM may still hold its GPU and disk"]
    assert plan.block == ["h1-s0", "h1-s1"]
