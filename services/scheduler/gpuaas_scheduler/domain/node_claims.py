"""NodeClaims: one allocation's live claims on its node and the slots they hold, the consistency boundary of
the allocation's end (the cosmicpython aggregate: loaded whole under the node lock, changed only through its
methods, which check the moves and record them; the repository writes what was recorded).

**Ending.** `release` (the allocator's `allocation.released`) and `fail` (`allocation.failed`) decide, for every
slot the allocation holds, whether it goes back to `available` or waits for an operator in `cleanup_blocked`:

- a slot the host never wrote (no cleanup required) goes straight back, unless the transition log shows it
  went further than the host's word allows (provisioned, for a release; active, for a failure);
- a slot the host may have written goes through `cleanup` and back only with a wipe proof this scheduler, the
  slot's owner, finds to satisfy the slot's wipe policy (`wipe_problems`: the one place a proof is judged);
  for a failure, all or none (the host keeps its leases on every disk of the task until all are proven wiped);
- without proofs, a failure that touched the disks blocks them all, and a node held whole is drained.

The claim audit's settlement (`settle`) blocks every slot: nobody reported what became of the disks.

Either way the claims end (`released`): a blocked slot is kept out of service by its status, not by a claim
nobody would release. An end that arrives while a slot is in a status it cannot follow changes nothing
(`EndedOutOfOrder`).

**Moves.** Every slot move goes through `domain/slots.py`'s table: a move the table forbids raises before
anything is recorded, and a slot not in a status the move may start from stays where it is (the repository's
statement applies the same guard under the row lock).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .approval import wipe_verdict
from .slots import allowed_from, movable_from

ACTOR = "scheduler"
Proof = Mapping[str, Any]


class EndedOutOfOrder(RuntimeError):
    """An allocation's end arrived while a slot is in a status the move that end decides for it cannot follow
    (an `active` slot whose log does not show it provisioned under the allocation: the status and the log
    disagree). Its claims are kept and the message is retried, then dead-lettered with this text, instead of
    freeing claims of slots that may stay in use."""


@dataclass(frozen=True)
class HeldClaim:
    """A live claim and, for a slot claim, the slot as loaded (status, disk, wipe policy) and what the slot's
    transition log shows of it under this allocation."""

    node_id: str
    claim_kind: str  # slot | node_exclusive
    slot_id: str | None = None
    status: str | None = None
    nvme_by_id: str | None = None
    destructive_wipe_policy: str | None = None
    wipe_policy_site: str | None = None
    # The slot's transition log shows it in the status `log_to_check` named, under this allocation (False when
    # none was named).
    reached: bool = False

    def slot_facts(self) -> dict[str, Any]:
        """The slot as the wipe policy reads it (approval.wipe_verdict)."""
        return {
            "nvme_by_id": self.nvme_by_id,
            "destructive_wipe_policy": self.destructive_wipe_policy,
            "wipe_policy_site": self.wipe_policy_site,
        }


@dataclass(frozen=True)
class SlotsMoved:
    """Move these slots, each only from a status in `only_from`, and log each transition."""

    slot_ids: tuple[str, ...]
    status: str
    reason: str | None
    only_from: tuple[str, ...]
    detail: dict[str, Any] | None = None
    health: tuple[str, str | None] | None = None
    actor: str = ACTOR


@dataclass(frozen=True)
class NodeDrained:
    node_id: str
    reason: str
    actor: str = ACTOR


Change = SlotsMoved | NodeDrained


@dataclass
class NodeClaims:
    allocation_id: str
    claims: tuple[HeldClaim, ...]
    changes: list[Change] = field(default_factory=list)
    released: bool = False
    # The slots its methods left `cleanup_blocked`, kept after the repository wrote the changes.
    blocked: set[str] = field(default_factory=set)

    @property
    def node_ids(self) -> list[str]:
        return sorted({c.node_id for c in self.claims})

    @property
    def slots(self) -> list[HeldClaim]:
        return [c for c in self.claims if c.slot_id]

    @property
    def blocking_nodes(self) -> list[str]:
        """The nodes of the slots its end left `cleanup_blocked`: their slots are announced (a slot given back
        healthy is not: the lifecycle events say enough of it)."""
        return sorted({c.node_id for c in self.claims if c.slot_id in self.blocked})

    @property
    def whole_nodes(self) -> list[str]:
        """The nodes held whole (a baremetal allocation's)."""
        return sorted({c.node_id for c in self.claims if c.claim_kind == "node_exclusive"})

    # --- the allocation's end ------------------------------------------------------------------------

    @staticmethod
    def log_to_check(event: str, cleanup_required: bool) -> str | None:
        """The status the transition log must be read for before `release` or `fail` (None: it is not read):
        only where the host says it never wrote a disk is its word checked against what the log shows."""
        if cleanup_required:
            return None
        return {"released": "provisioning", "failed": "active"}[event]

    def release(self, *, cleanup_required: bool, reason: str | None, proofs: Sequence[Proof]) -> None:
        """`allocation.released`: the host's cleanup report (whether the disks may have been written, and the
        wipe proofs of those it wiped)."""
        self._check_in_order("released", "cleanup" if cleanup_required else "available")
        slots = self.slots
        if slots and not cleanup_required:
            # Released before provisioning, the allocator says: no task ever went to the host. The claim's
            # log is the scheduler's own evidence of that, and a slot it shows provisioned waits for a wipe.
            detail = {"cleanup": "not required", "reason": reason}
            self._return_untouched({s.slot_id for s in slots if s.reached}, "provisioning", detail)
        elif slots:
            self._move([s.slot_id for s in slots], "cleanup", "verifying wipe proof", detail={"wipe_proofs": proofs})
            for slot, problem in self.wipe_problems(proofs).items():
                if problem is None:
                    self._wiped(slot, {})
                else:
                    # Tenant data may remain: out of service until an operator repairs it.
                    self._block([slot.slot_id], problem, {"wipe_proofs": proofs})
        self.released = True

    def fail(self, *, cleanup_required: bool, reason: str, proofs: Sequence[Proof]) -> None:
        """`allocation.failed`: back to available what provably was never written, or what every proof covers;
        otherwise blocked, and a node held whole drained."""
        self._check_in_order("failed", "cleanup_blocked" if cleanup_required else "available")
        slots = self.slots
        if not cleanup_required:
            # The host's word that no disk write began (its task record, written before the clone). A slot this
            # scheduler saw active held a running tenant VM, which no such word can undo.
            detail = {"failed_without_disk_writes": reason}
            self._return_untouched({s.slot_id for s in slots if s.reached}, "active", detail)
        elif slots and proofs:
            problems = self.wipe_problems(proofs)
            self._move(
                [s.slot_id for s in slots],
                "cleanup",
                "verifying wipe proof",
                detail={"failed": reason, "wipe_proofs": proofs},
            )
            if not any(problems.values()):
                for slot in slots:
                    self._wiped(slot, {"failed": reason})
            else:
                # All or none: the host keeps its leases on every disk of the task until all are proven wiped,
                # so a slot freed alone would be refused by it at the next provision.
                for slot, problem in problems.items():
                    why = problem or "another disk of the failed attempt is not proven wiped"
                    self._block([slot.slot_id], f"{reason}; {why}", {"wipe_proofs": proofs})
        else:
            # The attempt touched the disk (clone, boot) and nobody proved a wipe: never straight back to available.
            self._block([s.slot_id for s in slots], reason, None)
        if cleanup_required:
            for claim in self.claims:
                if claim.claim_kind == "node_exclusive":
                    self.changes.append(NodeDrained(claim.node_id, f"cleanup required after {reason}"[:500]))
        self.released = True

    def settle(self, audit_reason: str, *, machine_returned: bool, actor: str) -> None:
        """The claim audit found the allocation ended (or never known) at the allocator while its claims stayed
        live here: nobody reported what became of the disks, so every slot waits for an operator; a node held
        whole is drained, unless its machine came back from MAAS (it then leaves baremetal mode as on release)."""
        why = f"claim audit: {audit_reason}"[:500]
        statuses = {s.slot_id: s.status for s in self.slots}
        self._move(
            [s.slot_id for s in self.slots],
            "cleanup_blocked",
            why,
            detail={"claim_audit": audit_reason, "statuses": statuses},
            health=("failed", why),
            actor=actor,
        )
        if not machine_returned:
            self.changes.extend(NodeDrained(node_id, why, actor) for node_id in self.whole_nodes)
        self.released = True

    def wipe_problems(self, proofs: Sequence[Proof]) -> dict[HeldClaim, str | None]:
        """Per slot, why the host's wipe proofs do not free it (None: they do), by the slot's wipe policy."""
        return {slot: wipe_verdict(slot.slot_facts(), proofs) for slot in self.slots}

    # --- moves -----------------------------------------------------------------------------------------

    def _check_in_order(self, event: str, target: str) -> None:
        """Every slot can make the move `event` decides for it: `target`, or, for an end that says no disk was
        written, `cleanup_blocked` where the log shows the slot `reached` (`_return_untouched`)."""
        stuck = []
        for slot in self.slots:
            to = "cleanup_blocked" if slot.reached and target == "available" else target
            if slot.status not in allowed_from(to) | {to}:
                stuck.append(f"{slot.slot_id} ({slot.status}) to {to}")
        if stuck:
            raise EndedOutOfOrder(
                f"allocation.{event} for {self.allocation_id} cannot move {', '.join(sorted(stuck))}; claims kept"
            )

    def _move(
        self,
        slot_ids: Sequence[str | None],
        status: str,
        reason: str | None,
        *,
        only_from: Sequence[str] | None = None,
        detail: Mapping[str, Any] | None = None,
        health: tuple[str, str | None] | None = None,
        actor: str = ACTOR,
    ) -> None:
        ids = tuple(s for s in slot_ids if s)
        if not ids:
            return
        sources = tuple(movable_from(status, list(only_from) if only_from is not None else None))
        if status == "cleanup_blocked":
            self.blocked.update(ids)
        self.changes.append(
            SlotsMoved(ids, status, reason, sources, dict(detail) if detail is not None else None, health, actor)
        )

    def _wiped(self, slot: HeldClaim, detail: Mapping[str, Any]) -> None:
        self._move(
            [slot.slot_id],
            "available",
            None,
            only_from=("cleanup",),
            detail={**detail, "wipe_verified": slot.nvme_by_id},
            health=("healthy", f"wipe verified for {slot.nvme_by_id}"),
        )

    def _block(self, slot_ids: Sequence[str | None], problem: str, detail: Mapping[str, Any] | None) -> None:
        # Runbook: a failed cleanup marks the slot failed.
        self._move(slot_ids, "cleanup_blocked", problem[:500], detail=detail, health=("failed", problem[:500]))

    def _return_untouched(self, contradicted: set[str | None], reached: str, detail: Mapping[str, Any]) -> None:
        """Slots reported never written: back to available, unless the claim's log shows them `reached`."""
        self._move([s.slot_id for s in self.slots if s.slot_id not in contradicted], "available", None, detail=detail)
        for slot_id in sorted(s for s in contradicted if s):
            problem = f"reported never written, but the slot was {reached} under allocation {self.allocation_id}"
            self._block([slot_id], problem, detail)
