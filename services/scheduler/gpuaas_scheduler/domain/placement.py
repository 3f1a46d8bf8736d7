"""Placement as small pure functions: slot completeness, slot choice and node scoring.

Deterministic by construction: every ordering ends on a unique id, so the same inventory and the
same request always produce the same choice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class SlotView:
    slot_id: str
    numa_node: int | None
    pcie_switch: str | None


@dataclass(frozen=True)
class NodeCandidate:
    node_id: str
    free_slots: int
    total_slots: int
    live_claims: int


def incomplete_reason(slot: dict) -> str | None:
    """Why a slot bundle may not be handed to a tenant, or None when it is complete."""
    if not slot.get("gpu_pci_address"):
        return "missing GPU PCI address"
    if not slot.get("nvme_by_id") or "/by-id/" not in slot["nvme_by_id"]:
        return "missing raw NVMe by-id identity"
    if not slot.get("mac"):
        return "missing management MAC"
    if not slot.get("private_ip"):
        return "missing private IP"
    if slot.get("fabric_claim_mode") != "per_slot_vf":
        return "fabric claim mode is not per_slot_vf"
    if not slot.get("fabric_vf_pci_address"):
        return "missing fabric VF PCI address"
    return None


# The same predicates as SQL, so a row made 'available' by hand is still never placed.
COMPLETE_SLOT_SQL = (
    "s.gpu_pci_address IS NOT NULL AND s.nvme_by_id LIKE '%/by-id/%' AND s.mac IS NOT NULL "
    "AND s.private_ip IS NOT NULL AND s.fabric_claim_mode = 'per_slot_vf' "
    "AND COALESCE(s.fabric_vf_pci_address, '') <> ''"
)


def choose_slots(slots: Iterable[SlotView], count: int) -> list[SlotView] | None:
    """Pick `count` slots, preferring one PCIe switch, then one NUMA node, then the lowest ids."""
    slots = sorted(slots, key=lambda s: s.slot_id)
    if len(slots) < count:
        return None
    if count == 1:
        return slots[:1]
    for key in (lambda s: s.pcie_switch, lambda s: s.numa_node):
        groups: dict[object, list[SlotView]] = {}
        for slot in slots:
            groups.setdefault(key(slot), []).append(slot)
        fitting = [g for k, g in groups.items() if k is not None and len(g) >= count]
        if fitting:
            # Best fit inside the topology domain: the tightest group that still holds the request.
            best = min(fitting, key=lambda g: (len(g), g[0].slot_id))
            return best[:count]
    return slots[:count]


def node_score(candidate: NodeCandidate, requested: int) -> tuple:
    """Lower sorts first. Prefer nodes already sliced (keep clean hosts whole for baremetal),
    then the tightest fit (fewest free slots left over), then the id for determinism."""
    already_sliced = candidate.live_claims > 0 or candidate.free_slots < candidate.total_slots
    return (0 if already_sliced else 1, candidate.free_slots - requested, candidate.node_id)


def rank_nodes(candidates: Iterable[NodeCandidate], requested: int) -> list[NodeCandidate]:
    return sorted((c for c in candidates if c.free_slots >= requested), key=lambda c: node_score(c, requested))


def unschedulable_summary(filtered: Counter[str], free_gpus: int, requested: int) -> tuple[str, str]:
    if free_gpus == 0:
        return "no_capacity", f"no GPU is free in the region; {requested} requested"
    if free_gpus >= requested:
        return (
            "fragmented",
            f"{free_gpus} GPUs free in aggregate but no single node has {requested} eligible slots",
        )
    return "insufficient_capacity", f"{free_gpus} GPUs free, {requested} requested"
