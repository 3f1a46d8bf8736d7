"""Slot eligibility, defined once in domain/slots.py, means the same in Python and in the placement SQL:
both are evaluated on the same slots, a good one and one per violated rule."""

from __future__ import annotations

import json

import asyncpg
import pytest

from gpuaas_scheduler.adapters.slot_sql import ELIGIBLE_SLOT_SQL, RULE_SQL
from gpuaas_scheduler.domain.slots import ELIGIBILITY_RULES, broken_rules, eligible

GOOD = {
    "status": "available",
    "health_state": "healthy",
    "gpu_pci_address": "0000:18:00.0",
    "nvme_by_id": "/dev/disk/by-id/nvme-SAMSUNG_1",
    "mac": "52:54:00:00:00:01",
    "private_ip": "127.100.0.10",
    "fabric_claim_mode": "per_slot_vf",
    "fabric_vf_pci_address": "0000:19:00.2",
    "nvme_evidence": {"is_os_disk": False, "mounted": False, "mounted_children": [], "signatures": []},
    "emulated": False,
}
# A lab host's slot: the disk, MAC and IP of the bundle, no GPU and no fabric VF.
GOOD_EMULATED = {
    **GOOD,
    "emulated": True,
    "gpu_pci_address": None,
    "fabric_claim_mode": "none",
    "fabric_vf_pci_address": None,
}
# One slot per rule that breaks exactly that rule (and a few more ways to break the disk rules).
VIOLATIONS = {
    "gpu_pci_address": [{"gpu_pci_address": None}, {"gpu_pci_address": ""}],
    "nvme_by_id": [{"nvme_by_id": "/dev/nvme0n1"}, {"nvme_by_id": None}],
    "mac": [{"mac": None}, {"mac": ""}],
    "private_ip": [{"private_ip": ""}],
    "fabric_claim_mode": [{"fabric_claim_mode": "shared"}, {"fabric_claim_mode": None}],
    "fabric_vf_pci_address": [{"fabric_vf_pci_address": ""}],
    # An emulated slot that names a GPU or VF would pass the GPU rules without being one.
    "emulated_passes_nothing": [{"emulated": True}, {"emulated": True, "gpu_pci_address": None}],
    "nvme_evidence": [{"nvme_evidence": None}],
    "not_os_disk": [
        {"nvme_evidence": {**GOOD["nvme_evidence"], "is_os_disk": True}},
        {"nvme_evidence": {k: v for k, v in GOOD["nvme_evidence"].items() if k != "is_os_disk"}},
    ],
    "not_mounted": [{"nvme_evidence": {**GOOD["nvme_evidence"], "mounted": True}}],
    "no_mounted_children": [{"nvme_evidence": {**GOOD["nvme_evidence"], "mounted_children": ["nvme0n1p1"]}}],
    "no_signatures": [
        {"nvme_evidence": {**GOOD["nvme_evidence"], "signatures": ["ext4"]}},
        {"nvme_evidence": {**GOOD["nvme_evidence"], "signatures": None}},
    ],
    "available": [{"status": "disabled"}, {"status": "cleanup_blocked"}],
    "healthy": [{"health_state": "degraded"}, {"health_state": "failed"}],
}
CASES = [("good", GOOD), ("good", GOOD_EMULATED)] + [
    (rule, {**GOOD, **change}) for rule, changes in VIOLATIONS.items() for change in changes
]


def test_every_rule_has_a_violating_case():
    assert set(VIOLATIONS) == {r.name for r in ELIGIBILITY_RULES} == set(RULE_SQL)


@pytest.fixture
async def conn(fresh_db):
    c = await asyncpg.connect(fresh_db)
    yield c
    await c.close()


async def _sql_verdict(conn, slot: dict, predicate: str) -> bool:
    cols = list(GOOD)
    types = {"nvme_evidence": "jsonb", "emulated": "boolean"}
    values = ", ".join(f"${i}::{types.get(c, 'text')}" for i, c in enumerate(cols, 1))
    args = [json.dumps(slot[c]) if c == "nvme_evidence" and slot[c] is not None else slot[c] for c in cols]
    return await conn.fetchval(f"SELECT {predicate} FROM (VALUES ({values})) AS s({', '.join(cols)})", *args)


@pytest.mark.parametrize("name, slot", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
async def test_python_and_sql_agree_rule_by_rule(conn, name: str, slot: dict) -> None:
    broken = {r.name for r in broken_rules(slot)}
    # Without evidence nothing about the disk can be shown: those rules fail with it.
    expected = (
        {"nvme_evidence", "not_os_disk", "not_mounted", "no_signatures"}
        if slot["nvme_evidence"] is None
        else (set() if name == "good" else {name})
    )
    assert broken == expected, "the case breaks other rules than it names"
    assert await _sql_verdict(conn, slot, ELIGIBLE_SLOT_SQL) is eligible(slot)
    for rule in ELIGIBILITY_RULES:
        assert await _sql_verdict(conn, slot, RULE_SQL[rule.name]) is rule.holds(slot), rule.name
