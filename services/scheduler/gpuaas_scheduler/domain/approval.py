"""Slot approval rules from the slice runbook, as pure functions.

A candidate becomes an `available` slot only when every runtime-critical binding is present and the
raw disk is provably free; anything else is approved as `disabled` carrying every problem found, so
the operator sees the whole list at once rather than one rule per attempt.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .slots import BINDING_RULES, broken_rules


def disk_problems(evidence: Mapping[str, Any] | None) -> list[str]:
    """NVMe evidence must show an unmounted, non-OS disk without mounted children or signatures."""
    if evidence is None:
        return ["no NVMe evidence from topology discovery"]
    problems = []
    if evidence.get("is_os_disk", True):
        problems.append("NVMe is (or may be) the OS disk")
    if evidence.get("mounted", True):
        problems.append("NVMe is mounted")
    children = evidence.get("mounted_children") or []
    if children:
        problems.append(f"NVMe has mounted children: {', '.join(map(str, children))}")
    signatures = evidence.get("signatures")
    if signatures is None:
        problems.append("NVMe signatures could not be read")
    elif signatures:
        problems.append(f"NVMe carries unexpected filesystems/signatures: {', '.join(map(str, signatures))}")
    return problems


def binding_problems(candidate: Mapping[str, Any]) -> list[str]:
    """Every missing binding at once (the eligibility rules of domain/slots.py), for the operator."""
    return [rule.problem for rule in broken_rules(candidate, BINDING_RULES)]


def duplicate_problems(candidate: Mapping[str, Any], others: Iterable[Mapping[str, Any]]) -> list[str]:
    """Bindings already owned by another slot of the node: reused fabric or disks never sell twice."""
    problems = []
    for other in others:
        if other.get("slot_id") == candidate.get("slot_id"):
            continue
        for key in ("nvme_by_id", "mac", "private_ip", "fabric_vf_pci_address"):
            value = candidate.get(key)
            if value and value == other.get(key):
                problems.append(f"{key} {value} already bound to slot {other.get('slot_id')}")
    return problems


def _gpu_slot(slot: Mapping[str, Any]) -> bool:
    return bool(slot.get("gpu_pci_address")) and not slot.get("emulated")


def module_problems(candidate: Mapping[str, Any], others: Iterable[Mapping[str, Any]]) -> list[str]:
    """The host's GPU -> module ID map must be consistent: every GPU slot of the node carries a module ID or
    none does, and no module ID is carried twice. `others`: the node's other GPU slots as they will be after
    this approval (the rest of the batch, and the unretired slots it does not replace).

    A host whose GPUs carry none (older evidence, a board without module IDs) is approved as before and placed
    by the PCIe-switch and NUMA rules; one that carries some is placed on NVLink partitions, which a missing
    or doubled module ID would make wrong."""
    if not _gpu_slot(candidate):
        return []
    gpus = [o for o in others if _gpu_slot(o) and o.get("gpu_pci_address") != candidate.get("gpu_pci_address")]
    mine = candidate.get("module_id")
    if mine is None:
        mapped = sorted(str(o["gpu_pci_address"]) for o in gpus if o.get("module_id") is not None)
        if mapped:
            return [f"GPU has no module ID while {len(mapped)} other GPUs of the node have one: rediscover the host"]
        return []
    problems = []
    if not 1 <= int(mine) <= 8:
        problems.append(f"module ID {mine} is not one of 1-8")
    unmapped = sorted(str(o["gpu_pci_address"]) for o in gpus if o.get("module_id") is None)
    if unmapped:
        problems.append(f"GPUs of the node without a module ID: {', '.join(unmapped)}: rediscover the host")
    twins = sorted(str(o["gpu_pci_address"]) for o in gpus if o.get("module_id") == mine)
    if twins:
        problems.append(f"module ID {mine} also reported for GPU {', '.join(twins)}")
    return problems


def approval_problems(
    candidate: Mapping[str, Any],
    others: Iterable[Mapping[str, Any]] = (),
    gpu_peers: Iterable[Mapping[str, Any]] | None = None,
) -> list[str]:
    """`gpu_peers`: the node's GPU slots after this approval, for the module ID rule (default: `others`)."""
    others = list(others)
    return (
        binding_problems(candidate)
        + disk_problems(candidate.get("nvme_evidence"))
        + duplicate_problems(candidate, others)
        + module_problems(candidate, others if gpu_peers is None else gpu_peers)
    )


def approved_status(problems: list[str]) -> tuple[str, str | None]:
    return ("disabled", "; ".join(problems)[:2000]) if problems else ("available", None)


# The site's destructive wipe policy between tenants (runbook: "Tenant isolation wipe policy: blkdiscard,
# nvme format, or site-specific secure erase path before any released slot can be reused") and the wipe
# methods whose proof satisfies it. The node agent reports `blkdiscard` (discard that reads back as zeros),
# `blkdiscard+zeroout`/`zeroout` (discard then written zeros) and, on the simulated file-backed disks,
# `zero_fill`: each leaves nothing of the tenant's data readable, so each satisfies `blkdiscard`. A format or
# a crypto erase is only proven by that very method.
WIPE_POLICIES: dict[str, frozenset[str]] = {
    "blkdiscard": frozenset({"blkdiscard", "blkdiscard+zeroout", "zeroout", "zero_fill"}),
    "nvme_format": frozenset({"nvme_format"}),
    "crypto_erase": frozenset({"crypto_erase", "nvme_format_crypto", "nvme_sanitize_crypto"}),
}
DEFAULT_WIPE_POLICY = "blkdiscard"
STORAGE_OWNERSHIPS = frozenset({"slice"})
STORAGE_MODES = frozenset({"slice"})
STORAGE_IDENTITY_KINDS = frozenset({"nvme_wwn_by_id"})


def wipe_verdict(slot: Mapping[str, Any], proofs: Iterable[Mapping[str, Any]]) -> str | None:
    """None when a verified proof, made by a method of the slot's wipe policy, covers this slot's disk with no
    signatures left, else why not. The policy is the slot's effective one: its site's when `wipe_policy_site`
    names the site that set it, else the one recorded at approval."""
    device = slot.get("nvme_by_id")
    policy = slot.get("destructive_wipe_policy") or DEFAULT_WIPE_POLICY
    whose = f"site {slot['wipe_policy_site']}'s" if slot.get("wipe_policy_site") else "the slot's"
    accepted = WIPE_POLICIES.get(policy)
    if accepted is None:
        return f"slot wipe policy {policy!r} is unknown"
    mine = [p for p in proofs if p.get("device") == device]
    if not mine:
        return f"no wipe proof for {device}"
    for proof in mine:
        if proof.get("method") not in accepted:
            return (
                f"wipe of {device} by {proof.get('method')!r} does not satisfy {whose} {policy} policy "
                f"(accepted: {', '.join(sorted(accepted))})"
            )
        if not proof.get("verified"):
            return f"wipe of {device} not verified ({proof.get('method')}): {proof.get('detail') or 'no detail'}"
        if proof.get("signatures"):
            return f"signatures remain on {device}: {', '.join(proof['signatures'])}"
    return None
