"""The slot approval gate and its waivers (domain/readiness_gate.py), one row per case."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpuaas_scheduler.domain.readiness_gate import GATE_NAMES, MAX_WAIVER, approval_gate, waiver_problems

READY = {"parity_failures": 0, "preflight_status": "passed"}
NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)

GATE_CASES = [
    # (name, node, waived gates, expected problems, expected waived)
    ("ready", READY, (), set(), set()),
    ("never_reported", {"parity_failures": None, "preflight_status": None}, (), {"parity", "preflight"}, set()),
    ("parity_failing", {**READY, "parity_failures": 2}, (), {"parity"}, set()),
    ("parity_reset", {**READY, "parity_failures": None}, (), {"parity"}, set()),
    ("preflight_failed", {**READY, "preflight_status": "failed"}, (), {"preflight"}, set()),
    ("preflight_missing_status", {**READY, "preflight_status": "missing"}, (), {"preflight"}, set()),
    ("parity_waived", {**READY, "parity_failures": 2}, ("parity",), set(), {"parity"}),
    ("wrong_gate_waived", {**READY, "parity_failures": 2}, ("preflight",), {"parity"}, set()),
    ("both_waived", {"parity_failures": 1, "preflight_status": "failed"}, GATE_NAMES, set(), {"parity", "preflight"}),
    # A waiver of a gate that passes anyway is not used.
    ("waiver_unused", READY, ("parity",), set(), set()),
]


@pytest.mark.parametrize(
    ("node", "waived", "problems", "used"), [c[1:] for c in GATE_CASES], ids=[c[0] for c in GATE_CASES]
)
def test_approval_gate(node, waived, problems, used) -> None:
    verdict = approval_gate(node, waived)
    assert set(verdict.problems) == problems and set(verdict.waived) == used
    assert all(verdict.problems.values()) and all(verdict.waived.values())


def test_gate_problems_say_what_the_evidence_says() -> None:
    verdict = approval_gate({"parity_failures": 3, "preflight_status": "failed"})
    assert "3 failure(s)" in verdict.problems["parity"]
    assert "preflight is failed" in verdict.problems["preflight"]


WAIVER_CASES = [
    # (name, gate, reason, expires_at, needles of the expected problems)
    ("valid", "parity", "BF3 swap, parity re-run tomorrow", NOW + timedelta(days=1), []),
    ("at_most_the_max", "preflight", "MAAS down", NOW + MAX_WAIVER, []),
    ("no_reason", "parity", None, NOW + timedelta(days=1), ["reason"]),
    ("blank_reason", "parity", "   ", NOW + timedelta(days=1), ["reason"]),
    ("no_expiry", "parity", "why", None, ["expiry"]),
    ("expired", "parity", "why", NOW - timedelta(seconds=1), ["not in the future"]),
    ("now", "parity", "why", NOW, ["not in the future"]),
    ("too_far", "parity", "why", NOW + MAX_WAIVER + timedelta(seconds=1), ["30 days"]),
    ("naive_time", "parity", "why", datetime(2026, 5, 2), ["time zone"]),
    ("unknown_gate", "drift", "why", NOW + timedelta(days=1), ["gate must be"]),
    ("nothing", None, None, None, ["gate must be", "reason", "expiry"]),
]


@pytest.mark.parametrize(
    ("gate", "reason", "expires_at", "needles"), [c[1:] for c in WAIVER_CASES], ids=[c[0] for c in WAIVER_CASES]
)
def test_waiver_problems(gate, reason, expires_at, needles) -> None:
    problems = waiver_problems(gate, reason, expires_at, NOW)
    assert len(problems) == len(needles)
    for needle, problem in zip(needles, problems, strict=True):
        assert needle in problem
