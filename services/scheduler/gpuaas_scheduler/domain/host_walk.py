"""The way back to slice mode for a `converting` host, as a state machine the scheduler owns. Pure: no I/O.

A converting host is redeployed through MAAS with the slice-host site profile, then walks

    redeploy_requested → deployed → rediscovered → parity_passed → reapproved

or stops with a reason at the first failure: a failed deploy, a rediscovery that could not be asked or whose
report was not applied, a failing or stale parity report, a re-approval the readiness gate or the slot rules
refuse (a slot the host had that rediscovery did not find again among them), the host moved out of converting
by hand. A stopped walk is never tried again by itself (a retry loop against a host
that fails parity only hides it): the next walk starts when the host enters converting again.

Why (runbooks: slice-node-bootstrap, "the deployed-host bootstrap runs through cloud-init, MAAS deploy
userdata"; "Persistent VFIO binding: apply only after the node is intentionally in slice mode and the approved
topology profile is known"): a host back from a tenant or from commissioning has a new OS, so its slice
bootstrap comes from a slice-host deploy, and nothing learnt before describes it until it is rediscovered and
passes parity. Re-approval gives back exactly the slots the host had when it left slice mode (ops approved
those; a new GPU or disk is ops' call, not the walk's), through the same approval rules and readiness gate as
an operator's.

Each step is driven by a message that already exists (maas.deploy_result, node.topology_reported,
node.parity_reported) and answers with the commands the scheduler sends in the same unit of work
(`commands`). Topology and parity arrive on separate durables, so parity may come first: a pass is kept and
judged once rediscovery is in; a failure stops the walk at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from gpuaas_common.contract import HostMode

REDEPLOY_REQUESTED, DEPLOYED, REDISCOVERED, PARITY_PASSED, REAPPROVED, STOPPED = (
    "redeploy_requested",
    "deployed",
    "rediscovered",
    "parity_passed",
    "reapproved",
    "stopped",
)
STATES = (REDEPLOY_REQUESTED, DEPLOYED, REDISCOVERED, PARITY_PASSED, REAPPROVED, STOPPED)
OPEN = (REDEPLOY_REQUESTED, DEPLOYED, REDISCOVERED, PARITY_PASSED)


@dataclass(frozen=True)
class ApprovedSlot:
    """A slot the host had approved when it left slice mode: what re-approval gives back."""

    slot_id: str
    gpu_pci_address: str | None
    profile: str | None = None


@dataclass(frozen=True)
class RequestDeploy:
    walk_id: str
    node_id: str
    system_id: str
    profile: str


@dataclass(frozen=True)
class AskRediscovery:
    walk_id: str
    node_id: str


@dataclass(frozen=True)
class Reapprove:
    walk_id: str
    node_id: str
    slots: tuple[ApprovedSlot, ...]


Command = RequestDeploy | AskRediscovery | Reapprove


@dataclass(frozen=True)
class Step:
    """One line of the node's walk history: where the walk went, and why."""

    walk_id: str
    node_id: str
    from_state: str | None
    to_state: str
    reason: str
    at: datetime


@dataclass(frozen=True)
class WalkState:
    walk_id: str
    node_id: str
    state: str
    reason: str
    slots: tuple[ApprovedSlot, ...]
    profile: str | None = None
    rediscover_action_id: str | None = None
    # A passing parity verdict for this walk's rediscovery that came before its topology report.
    parity_passed_early: bool = False


class WalkError(Exception):
    """A call the walk's state does not allow: a bug of the caller, never a host's answer."""


@dataclass
class HostWalk:
    state_: WalkState
    steps: list[Step] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    # Whether the walk has no row yet (the adapter inserts rather than updates).
    new: bool = False

    @property
    def state(self) -> str:
        return self.state_.state

    @property
    def walk_id(self) -> str:
        return self.state_.walk_id

    @property
    def node_id(self) -> str:
        return self.state_.node_id

    @property
    def reason(self) -> str:
        return self.state_.reason

    # --- start ------------------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        walk_id: str,
        node_id: str,
        *,
        mode: str,
        slots: Iterable[ApprovedSlot],
        profile: str | None,
        system_id: str | None,
        at: datetime,
    ) -> HostWalk:
        """The walk of a host that entered converting. One that cannot start is recorded stopped at once, so the
        node's history says why nothing happens."""
        if mode != HostMode.CONVERTING:
            raise WalkError(f"{node_id} is {mode}: only a converting host walks back to slice mode")
        kept = tuple(sorted(slots, key=lambda s: s.slot_id))
        w = cls(WalkState(walk_id, node_id, REDEPLOY_REQUESTED, "", kept, profile), new=True)
        if not profile:
            problem = "no slice-host site profile is set (GPUAAS_SLICE_HOST_PROFILE): the host is onboarded by hand"
        elif not system_id:
            problem = "the host has no MAAS machine (maas_system_id) to redeploy"
        elif not kept:
            problem = "no slot was approved when the host left slice mode: nothing to re-approve; approve by hand"
        else:
            problem = None
        if problem is not None:
            w._move(STOPPED, problem, at, first=True)
            return w
        assert profile is not None and system_id is not None
        w._move(REDEPLOY_REQUESTED, f"redeploy through MAAS with the site profile {profile}", at, first=True)
        w.commands.append(RequestDeploy(walk_id, node_id, system_id, profile))
        return w

    # --- the answers --------------------------------------------------------------------------------------

    def deploy_result(self, status: str, detail: str, at: datetime) -> None:
        if self.state != REDEPLOY_REQUESTED:
            return  # sent again (the gateway answers a repeated command again): taken already
        if status == "deployed":
            self._move(DEPLOYED, "MAAS deployed the slice-host profile; rediscovery asked of the host's agent", at)
            self.commands.append(AskRediscovery(self.walk_id, self.node_id))
        else:
            self._move(STOPPED, f"the slice-host deploy failed: {detail or 'no reason given'}", at)

    def rediscovery_asked(self, action_id: str) -> None:
        if self.state != DEPLOYED:
            raise WalkError(f"walk {self.walk_id} is {self.state}: no rediscovery to ask")
        self.state_ = replace(self.state_, rediscover_action_id=action_id)

    def rediscovery_refused(self, problems: list[str], at: datetime) -> None:
        if self.state != DEPLOYED:
            raise WalkError(f"walk {self.walk_id} is {self.state}: no rediscovery to ask")
        self._move(STOPPED, "rediscovery could not be asked: " + "; ".join(problems), at)

    def topology(self, action_id: str | None, succeeded: bool, outcome: str, at: datetime) -> None:
        if not self._ours(action_id) or self.state != DEPLOYED:
            return
        if not succeeded:
            self._move(STOPPED, f"rediscovery failed: {outcome}", at)
            return
        self._move(REDISCOVERED, f"rediscovered: {outcome}", at)
        if self.state_.parity_passed_early:
            self._parity_passed("parity passed (reported before the topology)", at)

    def parity(self, action_id: str | None, succeeded: bool, outcome: str, at: datetime) -> None:
        if not self._ours(action_id) or self.state not in (DEPLOYED, REDISCOVERED):
            return
        if not succeeded:
            self._move(STOPPED, f"parity failed: {outcome}", at)
        elif self.state == DEPLOYED:
            self.state_ = replace(self.state_, parity_passed_early=True)
        else:
            self._parity_passed(outcome, at)

    def reapproval(self, mode_after: str, problems: list[str], at: datetime) -> None:
        if self.state != PARITY_PASSED:
            raise WalkError(f"walk {self.walk_id} is {self.state}: no re-approval pending")
        if problems or mode_after != HostMode.SLICE:
            why = "; ".join(problems) or f"the host stayed {mode_after}"
            self._move(STOPPED, f"re-approval refused: {why}", at)
        else:
            self._move(REAPPROVED, f"{len(self.state_.slots)} slot(s) re-approved: the host is in slice mode", at)

    def host_left_converting(self, mode: str, actor: str, at: datetime) -> None:
        if self.state in OPEN:
            self._move(STOPPED, f"{actor} moved the host to {mode} during the walk", at)

    # --- helpers -----------------------------------------------------------------------------------------

    def _ours(self, action_id: str | None) -> bool:
        # The agent's own start-up report and other askers' tasks say nothing about this walk's rediscovery.
        return action_id is not None and action_id == self.state_.rediscover_action_id

    def _parity_passed(self, outcome: str, at: datetime) -> None:
        self._move(PARITY_PASSED, f"{outcome}; re-approving the slots the host had when it left slice mode", at)
        self.commands.append(Reapprove(self.walk_id, self.node_id, self.state_.slots))

    def _move(self, to: str, reason: str, at: datetime, *, first: bool = False) -> None:
        self.steps.append(Step(self.walk_id, self.node_id, None if first else self.state, to, reason, at))
        self.state_ = replace(self.state_, state=to, reason=reason)


def match_candidates(
    slots: Iterable[ApprovedSlot], candidates: Iterable[Mapping[str, Any]]
) -> tuple[dict[str | None, list[str]], list[str]]:
    """The rediscovered candidates that are the given slots again, by GPU (an emulated slot, which has none,
    by the candidate id its slot was approved from), grouped by the slot's profile; and the slots none matches."""
    cands = list(candidates)
    by_gpu = {c["gpu_pci_address"]: c["candidate_id"] for c in cands if c.get("gpu_pci_address")}
    by_id = {c["candidate_id"] for c in cands}
    groups: dict[str | None, list[str]] = {}
    missing = []
    for s in slots:
        found = by_gpu.get(s.gpu_pci_address) if s.gpu_pci_address else (s.slot_id if s.slot_id in by_id else None)
        if found is None:
            missing.append(s.slot_id)
        else:
            groups.setdefault(s.profile, []).append(found)
    return groups, missing
