"""The readiness gate of slot approval, and the waivers that are its only override. Pure.

slice-node-bootstrap: "Commissioning should decide whether the node is firmware-capable"; "Only approve
node_resource_slots after validation passes"; the parity run must end with `failures=0` "before trusting slice
capacity in the scheduler". So approving a host's slots requires both, as the host's *current* evidence says
them: a parity run the agent reported (a fleet seed or an evidence reset leaves none) with no failure, and a
commissioning preflight that passed.

An operator who must approve anyway records a *waiver*: one gate, who, why and until when. It lets approval
through that gate while it lasts and is kept and audited; it never rewrites the evidence, so placement, which
gates on the evidence itself, still waits for the host to pass. A waiver without a reason or an expiry, or one
that ends in the past or too far ahead, is refused with the reasons.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

Node = Mapping[str, Any]

# Long enough to bridge a repair window, short enough that a forgotten waiver runs out on its own.
MAX_WAIVER = timedelta(days=30)


def _parity(node: Node) -> str | None:
    # Nothing but a parity report writes these (a seed and an evidence reset leave them NULL).
    if node.get("parity_failures") is None:
        return "no parity run reported by the host's agent since its evidence was last reset"
    if node["parity_failures"]:
        return f"the host's last parity run reported {node['parity_failures']} failure(s)"
    return None


def _preflight(node: Node) -> str | None:
    status = node.get("preflight_status")
    if status == "passed":
        return None
    if status is None:
        return "no commissioning preflight reported for the host"
    return f"the host's commissioning preflight is {status}"


@dataclass(frozen=True)
class Gate:
    name: str
    problem: Callable[[Node], str | None]


APPROVAL_GATES = (Gate("parity", _parity), Gate("preflight", _preflight))
GATE_NAMES = tuple(g.name for g in APPROVAL_GATES)


@dataclass(frozen=True)
class GateVerdict:
    # Gates the evidence fails and no waiver covers: approval is refused with these.
    problems: dict[str, str]
    # Gates the evidence fails that an active waiver lets through: approval records which.
    waived: dict[str, str]


def approval_gate(node: Node, waived_gates: Iterable[str] = ()) -> GateVerdict:
    waivers = set(waived_gates)
    problems: dict[str, str] = {}
    waived: dict[str, str] = {}
    for gate in APPROVAL_GATES:
        problem = gate.problem(node)
        if problem is None:
            continue
        (waived if gate.name in waivers else problems)[gate.name] = problem
    return GateVerdict(problems, waived)


def waiver_problems(gate: str | None, reason: str | None, expires_at: datetime | None, now: datetime) -> list[str]:
    """Every reason a waiver cannot be recorded, at once."""
    problems = []
    if gate not in GATE_NAMES:
        problems.append(f"gate must be one of {', '.join(GATE_NAMES)}")
    if not (reason or "").strip():
        problems.append("a waiver needs a reason")
    if expires_at is None:
        problems.append("a waiver needs an expiry (expires_at)")
    elif expires_at.tzinfo is None:
        problems.append("expires_at needs a time zone")
    elif expires_at <= now:
        problems.append("expires_at is not in the future")
    elif expires_at - now > MAX_WAIVER:
        problems.append(f"expires_at is more than {MAX_WAIVER.days} days ahead")
    return problems
