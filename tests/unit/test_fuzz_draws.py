"""What the fuzzer draws: live ids reach the receivers that can judge them, never the allocator's own word."""

import json

from gpuaas_dev.testing.fuzz import Fuzzer, Pools

LIVE = "bbbbbbbb-0000-4000-8000-000000000000"


def _generated_naming_live(seed: int) -> list[tuple[str, str]]:
    pools = Pools(nodes=["slice-01", "slice-02"], allocations=[LIVE] * 20, tasks=["task-1"])
    out = []
    for item in Fuzzer(seed, pools).draw(1500):
        if item.category != "generated":
            continue
        payload = json.loads(item.body)["payload"]
        if payload.get("allocation_id") == LIVE:
            out.append((item.identity, item.type or "?"))
    return out


def test_messages_in_the_allocators_name_never_name_a_live_allocation():
    # A forged allocation.releasing then allocation.released in the allocator's name is a real release to the
    # scheduler: the fuzz run once freed the claims of an allocation that stayed active that way.
    for seed in (20261123, 1, 2):
        hits = _generated_naming_live(seed)
        assert [h for h in hits if h[0] == "allocator"] == []
        # Others still name live allocations: placements, portal requests, host results are judged by the receiver.
        assert {identity for identity, _ in hits} - {"allocator"}
