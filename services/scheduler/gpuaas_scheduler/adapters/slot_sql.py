"""The slot eligibility rules of domain/slots.py as SQL over `node_resource_slots s`.

One predicate per rule *name*; importing this module fails if a rule has no predicate or a predicate no
rule, and tests/integration/test_slot_rules.py evaluates every rule both ways on the same slots.
"""

from __future__ import annotations

from ..domain.slots import ELIGIBILITY_RULES


def _text(col: str) -> str:
    # The domain treats an empty string as missing, so must the SQL.
    return f"COALESCE(s.{col}, '') <> ''"


def _gpu_part(predicate: str) -> str:
    return f"s.emulated OR {predicate}"


RULE_SQL: dict[str, str] = {
    "gpu_pci_address": _gpu_part(_text("gpu_pci_address")),
    "nvme_by_id": "COALESCE(s.nvme_by_id, '') LIKE '%/by-id/%'",
    "mac": _text("mac"),
    "private_ip": _text("private_ip"),
    "fabric_claim_mode": _gpu_part("s.fabric_claim_mode IS NOT DISTINCT FROM 'per_slot_vf'"),
    "fabric_vf_pci_address": _gpu_part(_text("fabric_vf_pci_address")),
    "emulated_passes_nothing": (
        f"NOT s.emulated OR NOT ({_text('gpu_pci_address')} OR {_text('fabric_vf_pci_address')})"
    ),
    "nvme_evidence": "s.nvme_evidence IS NOT NULL",
    "not_os_disk": "NOT COALESCE((s.nvme_evidence->>'is_os_disk')::boolean, true)",
    "not_mounted": "NOT COALESCE((s.nvme_evidence->>'mounted')::boolean, true)",
    "no_mounted_children": "COALESCE(jsonb_array_length(s.nvme_evidence->'mounted_children'), 0) = 0",
    "no_signatures": "COALESCE(s.nvme_evidence->'signatures' = '[]'::jsonb, false)",
    "available": "s.status = 'available'",
    "healthy": "s.health_state = 'healthy'",
}

_names = {r.name for r in ELIGIBILITY_RULES}
if set(RULE_SQL) != _names:
    raise RuntimeError(f"slot rules and their SQL differ: {sorted(set(RULE_SQL) ^ _names)}")

ELIGIBLE_SLOT_SQL = " AND ".join(f"({RULE_SQL[r.name]})" for r in ELIGIBILITY_RULES)
