"""What a slot is allowed to be and to become — each rule written once.

**Eligibility.** A slot may be handed to a tenant only when every rule below holds. The approval API
uses them to list every problem of a candidate at once; placement re-checks them in SQL at claim time,
so a row made `available` by hand is still never placed. The SQL is not a second definition: it is a
map from these rule *names* to predicates (adapters/slot_sql.py), the map must cover exactly these
names, and a test evaluates both on the same slots, one violated rule at a time.

**Transitions.** `SLOT_TRANSITIONS` is every status change a slot may make; the adapter that moves
slots refuses any other; the one other writer, placement's claim, only takes `available` slots to `reserved`
(it selects them through the eligibility SQL), a move the table allows.

**Approval is not a transition.** It (re)writes a slot's whole binding from a candidate (GPU, disk,
fabric, evidence) and derives the status from the eligibility rules, whatever the status was; so it is
not an edge of the table, and putting its edges there (retired -> available above all) would let the
mover resurrect retired slots. Its own rule, `APPROVAL_REPLACES`, is checked by the same adapter
statement that writes the slot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuaas_common.contract import SlotStatus as S

Slot = Mapping[str, Any]


@dataclass(frozen=True)
class SlotRule:
    name: str
    problem: str
    holds: Callable[[Slot], bool]


def _present(key: str) -> Callable[[Slot], bool]:
    return lambda s: bool(s.get(key))


def _evidence(s: Slot) -> Mapping[str, Any] | None:
    return s.get("nvme_evidence")


def _disk_says(key: str, default: Any) -> Callable[[Slot], Any]:
    """A disk fact from the evidence; None when there is no evidence at all (which never passes)."""
    return lambda s: None if _evidence(s) is None else _evidence(s).get(key, default)  # type: ignore[union-attr]


def _emulated(s: Slot) -> bool:
    return s.get("emulated") is True


def _gpu_part(rule: Callable[[Slot], bool]) -> Callable[[Slot], bool]:
    """A GPU or fabric binding rule: an emulated slot has neither, by definition, and passes it."""
    return lambda s: _emulated(s) or rule(s)


# The runtime-critical bundle (slice-node-bootstrap: GPU, raw disk by stable id, management MAC/IP,
# one fabric VF of its own). An emulated slot (a lab host's disk standing for a GPU it does not pretend to
# have) is the bundle without GPU and VF, and must carry neither.
BINDING_RULES: tuple[SlotRule, ...] = (
    SlotRule("gpu_pci_address", "missing GPU PCI address", _gpu_part(_present("gpu_pci_address"))),
    SlotRule("nvme_by_id", "missing raw NVMe by-id identity", lambda s: "/by-id/" in (s.get("nvme_by_id") or "")),
    SlotRule("mac", "missing management MAC", _present("mac")),
    SlotRule("private_ip", "missing private IP", _present("private_ip")),
    SlotRule(
        "fabric_claim_mode",
        "fabric claim mode is not per_slot_vf",
        _gpu_part(lambda s: s.get("fabric_claim_mode") == "per_slot_vf"),
    ),
    SlotRule("fabric_vf_pci_address", "missing fabric VF PCI address", _gpu_part(_present("fabric_vf_pci_address"))),
    SlotRule(
        "emulated_passes_nothing",
        "an emulated slot names a GPU or fabric VF",
        lambda s: not _emulated(s) or not (s.get("gpu_pci_address") or s.get("fabric_vf_pci_address")),
    ),
)

# The raw disk is provably free: discovery saw it, and it is not the OS disk, not mounted, has no
# mounted children and no signatures (unreadable signatures count as present).
DISK_RULES: tuple[SlotRule, ...] = (
    SlotRule("nvme_evidence", "no NVMe evidence from topology discovery", lambda s: _evidence(s) is not None),
    SlotRule("not_os_disk", "NVMe is (or may be) the OS disk", lambda s: _disk_says("is_os_disk", True)(s) is False),
    SlotRule("not_mounted", "NVMe is mounted", lambda s: _disk_says("mounted", True)(s) is False),
    SlotRule("no_mounted_children", "NVMe has mounted children", lambda s: not _disk_says("mounted_children", [])(s)),
    SlotRule(
        "no_signatures",
        "NVMe carries signatures, or they could not be read",
        lambda s: _disk_says("signatures", None)(s) == [],
    ),
)

# What makes an approved, complete slot free to claim right now.
RUNTIME_RULES: tuple[SlotRule, ...] = (
    SlotRule("available", "slot is not available", lambda s: s.get("status") == S.AVAILABLE),
    SlotRule("healthy", "slot is not healthy", lambda s: s.get("health_state") == "healthy"),
)

ELIGIBILITY_RULES: tuple[SlotRule, ...] = BINDING_RULES + DISK_RULES + RUNTIME_RULES


def broken_rules(slot: Slot, rules: tuple[SlotRule, ...] = ELIGIBILITY_RULES) -> list[SlotRule]:
    return [r for r in rules if not r.holds(slot)]


def eligible(slot: Slot) -> bool:
    return not broken_rules(slot)


def incomplete_reason(slot: Slot) -> str | None:
    """The first missing binding, or None when the bundle is complete."""
    broken = broken_rules(slot, BINDING_RULES)
    return broken[0].problem if broken else None


# --- transitions -------------------------------------------------------------------------------------

# Every status; `awaiting_wipe`: approved, its disk owed a wipe proof from its own host (domain/slot_wipe.py),
# never placed meanwhile.
SLOT_STATUSES = tuple(S)
# Statuses in which a tenant's VM may have written the disk.
TOUCHED = frozenset({S.PROVISIONING, S.ACTIVE, S.RELEASING, S.CLEANUP})

SLOT_TRANSITIONS: dict[str, frozenset[str]] = {
    # Repaired, re-approved or retired by ops.
    S.DISABLED: frozenset({S.AVAILABLE, S.RETIRED}),
    # Claimed by placement; disabled or retired by ops. Owed a wipe when its host comes back from maintenance:
    # a technician may have swapped or touched its disk, whose past is then unknown (slot_wipe.py).
    S.AVAILABLE: frozenset({S.RESERVED, S.DISABLED, S.RETIRED, S.AWAITING_WIPE}),
    # A claim moves on, or ends before anything was written (back to available) or fails.
    S.RESERVED: frozenset({S.PROVISIONING, S.RELEASING, S.AVAILABLE, S.CLEANUP, S.CLEANUP_BLOCKED}),
    # From here the disk may have been written: back to available only when the attempt provably
    # never touched it (failed before the clone), else through cleanup with a verified wipe.
    S.PROVISIONING: frozenset({S.ACTIVE, S.RELEASING, S.AVAILABLE, S.CLEANUP, S.CLEANUP_BLOCKED}),
    S.ACTIVE: frozenset({S.RELEASING, S.CLEANUP, S.CLEANUP_BLOCKED}),
    S.RELEASING: frozenset({S.CLEANUP, S.AVAILABLE, S.CLEANUP_BLOCKED}),
    S.CLEANUP: frozenset({S.AVAILABLE, S.CLEANUP_BLOCKED}),
    # Tenant data may remain: only the host's own verified wipe (a repair asks for it) brings it back.
    S.CLEANUP_BLOCKED: frozenset({S.AVAILABLE}),
    # Someone else's data may remain: the host's passing wipe proof frees it, a failed or refused one blocks it.
    S.AWAITING_WIPE: frozenset({S.AVAILABLE, S.CLEANUP_BLOCKED}),
    S.RETIRED: frozenset(),
}


class InvalidSlotTransition(ValueError):
    pass


def allowed_from(to: str) -> frozenset[str]:
    """Every status a slot may be in to move to `to`."""
    if to not in SLOT_TRANSITIONS:
        raise InvalidSlotTransition(f"unknown slot status {to!r}")
    return frozenset(f for f, tos in SLOT_TRANSITIONS.items() if to in tos)


def check_slot_transition(current: str, new: str) -> None:
    if new not in SLOT_TRANSITIONS.get(current, frozenset()):
        raise InvalidSlotTransition(f"slot {current} -> {new} is not allowed")


def movable_from(to: str, only_from: tuple[str, ...] | list[str] | None) -> list[str]:
    """The statuses a move to `to` may start from: the caller's subset of the table's, and a caller that
    names a move the table forbids is a programming error, refused before any row is touched."""
    legal = allowed_from(to)
    if only_from is None:
        return sorted(legal)
    bad = [f for f in only_from if f not in legal]
    if bad:
        raise InvalidSlotTransition(f"slot {', '.join(bad)} -> {to} is not allowed")
    return list(only_from)


# --- approval ------------------------------------------------------------------------------------------

# Statuses under a live claim (a tenant's VM may be placed, running or being cleaned up).
IN_USE = frozenset({S.RESERVED, S.PROVISIONING, S.ACTIVE, S.RELEASING, S.CLEANUP})
# The statuses of an existing slot that approval may rewrite: no claim and no tenant data left on its
# disk (cleanup_blocked may still hold some; only a repair with a verified wipe frees it). A retired
# slot is among them: re-approval after rediscovery is the one way back from retired.
APPROVAL_REPLACES = frozenset(SLOT_STATUSES) - IN_USE - {S.CLEANUP_BLOCKED}
# What approval makes of a candidate (see approval.approved_status).
APPROVAL_RESULTS = frozenset({S.AVAILABLE, S.DISABLED, S.AWAITING_WIPE})


def check_approval(current: str | None, new: str) -> None:
    """current is None for a slot approval creates."""
    if new not in APPROVAL_RESULTS:
        raise InvalidSlotTransition(f"approval cannot make a slot {new}")
    if current is not None and current not in APPROVAL_REPLACES:
        raise InvalidSlotTransition(f"approval cannot replace a {current} slot")
