"""The claim audit's rule, one row per case: what the allocator says of an allocation decides whether the
scheduler keeps its claims, releases them (and whether a machine held whole is back with MAAS), or reports a
disagreement it must not resolve alone."""

from __future__ import annotations

import pytest

from gpuaas_scheduler.domain.claim_audit import AuditFacts, settle

ORPHAN_AFTER = 900.0
GRACE = 60.0

CASES = [
    # owner state, owner node, claim nodes, claims age, owner changed age -> action, machine returned, words
    (None, None, ("n1",), 30.0, 0.0, "keep", False, "no record yet"),
    (None, None, ("n1",), 899.0, 0.0, "keep", False, "no record yet"),
    (None, None, ("n1",), 901.0, 0.0, "release", False, "no record of the allocation for 901 s"),
    ("released", "n1", ("n1",), 500.0, 61.0, "release", True, "says released"),
    ("released", "n1", ("n1",), 500.0, 5.0, "keep", False, "may still be on its way"),
    ("failed", "n1", ("n1",), 500.0, 61.0, "release", False, "says failed"),
    ("unschedulable", None, ("n1",), 500.0, 61.0, "release", False, "says unschedulable"),
    ("active", "n1", ("n1",), 5000.0, 4000.0, "keep", False, "says active"),
    ("accepted", None, ("n1",), 500.0, 500.0, "keep", False, "says accepted"),
    ("releasing", "n1", ("n1",), 500.0, 500.0, "keep", False, "says releasing"),
    ("active", "n2", ("n1",), 500.0, 500.0, "report", False, "places it on n2, its claims are on n1"),
]


@pytest.mark.parametrize(("state", "node", "claims", "age", "changed", "action", "returned", "words"), CASES)
def test_the_owner_settles_the_claims(state, node, claims, age, changed, action, returned, words) -> None:
    verdict = settle(AuditFacts(state, node, claims, age, changed), ORPHAN_AFTER, GRACE)
    assert (verdict.action, verdict.machine_returned) == (action, returned)
    assert words in verdict.reason
