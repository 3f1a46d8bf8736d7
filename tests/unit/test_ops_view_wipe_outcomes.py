"""How a host's wipe outcomes read on its ops timeline (gpuaas_ops_view.domain.models.wipe_outcome_text): a proof
names its device, method and whether it was verified, what failed it, and a refusal names its reason."""

from __future__ import annotations

from typing import Any

import pytest

from gpuaas_common.contract import messages as m
from gpuaas_ops_view.domain.models import wipe_outcome_text, wipe_outcomes_text

DISK = "/dev/disk/by-id/nvme-eui.01"


def _proof(**kw: Any) -> dict[str, Any]:
    proof = m.WipeProof(device=DISK, method=kw.pop("method", "blkdiscard"), verified=kw.pop("verified", True), **kw)
    return m.SlotWipeOutcome(slot_id="s1", device=DISK, proof=proof).model_dump(mode="json")


@pytest.mark.parametrize(
    ("outcome", "text"),
    [
        (_proof(), f"s1 {DISK}: blkdiscard, verified"),
        (_proof(method="zero_fill"), f"s1 {DISK}: zero_fill, verified"),
        (
            _proof(verified=False, signatures=["ext4"], detail="signatures remain: ext4"),
            f"s1 {DISK}: blkdiscard, NOT verified, signatures remain: ext4 (signatures remain: ext4)",
        ),
        (
            m.SlotWipeOutcome(slot_id="s1", device=DISK, reason_code="disk_leased", reason="leased").model_dump(),
            f"s1 {DISK}: refused (disk_leased): leased",
        ),
        (
            m.SlotWipeOutcome(slot_id="s1", device=DISK, reason_code="disk_missing").model_dump(),
            f"s1 {DISK}: refused (disk_missing)",
        ),
    ],
)
def test_each_outcome_says_what_ops_need(outcome: dict[str, Any], text: str) -> None:
    assert wipe_outcome_text(outcome) == text


def test_a_reports_outcomes_read_in_its_order() -> None:
    second = {**_proof(), "slot_id": "s2"}
    assert wipe_outcomes_text([_proof(), second]) == f"s1 {DISK}: blkdiscard, verified; s2 {DISK}: blkdiscard, verified"
