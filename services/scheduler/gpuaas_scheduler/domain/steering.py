"""Steering a host on demand: which asks (rediscovery, a parity run, a commissioning) a node may be given now,
and what the host's answer means for the ask. Pure: no I/O.

Why the rules (runbooks: slice-node-bootstrap runs discovery and parity on the host itself, with the node agent
and host services up; maas-host-image-pipeline commissions a machine through MAAS, which reboots it into the
ephemeral environment): discovery and parity need the slice agent, which runs on a slice host in the modes that
keep its slice bootstrap (slice, drained, converting); a baremetal host is a tenant's machine or a MAAS-deployed
plain OS, and a retired one is out of the fleet. Commissioning takes the machine down, so nothing may run on it
and nothing new may land on it while it does. One open ask of a kind per node: a second one would only race the
first's report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from gpuaas_common.contract import HostMode

REDISCOVER, PARITY, COMMISSION = "rediscover", "parity", "commission"
KINDS = (REDISCOVER, PARITY, COMMISSION)
# Host modes in which the slice node agent runs and answers tasks (domain/host_mode.py).
SLICE_AGENT_MODES = (HostMode.SLICE, HostMode.DRAINED, HostMode.CONVERTING)


@dataclass(frozen=True)
class OpenAsk:
    action_id: str
    actor: str
    requested_at: datetime
    deadline: datetime


@dataclass(frozen=True)
class SteerFacts:
    """What the rules look at, read under the node's row lock."""

    node_id: str
    node_kind: str
    mode: str
    maas_system_id: str | None = None
    live_claims: int = 0
    # A slice-mode host neither drained nor in maintenance: the scheduler may place on it.
    takes_placements: bool = False
    open_ask: OpenAsk | None = None


Rule = Callable[[SteerFacts, str], "str | None"]


def slice_agent_runs(f: SteerFacts, kind: str) -> str | None:
    if f.node_kind != "slice_host":
        return f"{f.node_id} is a {f.node_kind} node: it runs no slice node agent to {kind}"
    if f.mode not in SLICE_AGENT_MODES:
        return (
            f"{f.node_id} is {f.mode}: its slice node agent answers only in {', '.join(SLICE_AGENT_MODES)} mode "
            "(a baremetal host belongs to its tenant or to MAAS; convert it first)"
        )
    return None


def has_machine(f: SteerFacts, kind: str) -> str | None:
    return None if f.maas_system_id else f"{f.node_id} has no MAAS machine (maas_system_id) to {kind}"


def no_live_claims(f: SteerFacts, kind: str) -> str | None:
    return (
        None
        if f.live_claims == 0
        else f"{f.live_claims} live claim(s) on {f.node_id}: commissioning reboots the machine under them"
    )


def takes_no_placements(f: SteerFacts, kind: str) -> str | None:
    return (
        None
        if not f.takes_placements
        else f"{f.node_id} takes placements: drain it (gpuaas nodes drain) or change its mode before commissioning"
    )


def nothing_open(f: SteerFacts, kind: str) -> str | None:
    a = f.open_ask
    if a is None:
        return None
    return (
        f"a {kind} of {f.node_id} asked by {a.actor} at {a.requested_at.isoformat()} is still open "
        f"({a.action_id}, until {a.deadline.isoformat()})"
    )


RULES: dict[str, tuple[Rule, ...]] = {
    REDISCOVER: (slice_agent_runs, nothing_open),
    PARITY: (slice_agent_runs, nothing_open),
    COMMISSION: (has_machine, no_live_claims, takes_no_placements, nothing_open),
}


def request_problems(facts: SteerFacts, kind: str) -> list[str]:
    """Every reason `kind` may not be asked of the node now; empty when it may."""
    rules = RULES.get(kind)
    if rules is None:
        return [f"unknown ask {kind!r}; asks: {', '.join(KINDS)}"]
    return [p for p in (r(facts, kind) for r in rules) if p is not None]


# --- the answer --------------------------------------------------------------------------------------------------

SUCCEEDED, FAILED, EXPIRED = "succeeded", "failed", "expired"
# Which report part settles each ask; other parts only add to its result (a rediscovery's parity run).
DECIDED_BY = {REDISCOVER: "topology", PARITY: "parity", COMMISSION: "preflight"}


@dataclass(frozen=True)
class Verdict:
    status: str
    outcome: str


def _not_applied(what: str, applied: str) -> Verdict | None:
    if applied == "applied":
        return None
    why = {
        "stale": "older than the host's last evidence reset or than a report already applied",
        "unknown_node": "for a node this scheduler does not know",
    }.get(applied, applied)
    return Verdict(FAILED, f"the {what} report was not applied: {why}")


def parity_verdict(applied: str, failures: int, failed_checks: list[str], warnings: int) -> Verdict:
    bad = _not_applied("parity", applied)
    if bad:
        return bad
    if failures:
        return Verdict(FAILED, f"parity reported {failures} failure(s): {', '.join(failed_checks) or 'unnamed'}")
    return Verdict(SUCCEEDED, f"parity passed ({warnings} warning(s))")


def topology_verdict(applied: str, candidates: int, blockers: list[str]) -> Verdict:
    bad = _not_applied("topology", applied)
    if bad:
        return bad
    if blockers:
        return Verdict(FAILED, f"discovery found {candidates} candidate(s) and blockers: {'; '.join(blockers)}")
    return Verdict(SUCCEEDED, f"discovery found {candidates} candidate(s)")


def preflight_verdict(status: str, reasons: list[str]) -> Verdict:
    if status == "passed":
        return Verdict(SUCCEEDED, "commissioning preflight passed")
    if status == "missing":
        return Verdict(FAILED, "the commissioning run has no result for the slice preflight script")
    return Verdict(FAILED, "commissioning preflight failed: " + ("; ".join(reasons) or "no reason given"))


def expired_outcome(kind: str) -> str:
    what = "MAAS gateway" if kind == COMMISSION else "node agent"
    return f"no report by the deadline: the {what} did not answer (down, or the ask was lost); ask again"
