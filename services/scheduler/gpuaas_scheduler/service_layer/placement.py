"""Place one accepted allocation inside the caller's transaction: quota, candidates in rank order,
node lock with SKIP LOCKED and fallback, claims; or a complete why-not answer.

Called by the bus handler (with the inbox row and the outbox in the same transaction) and directly by
the benchmark and the concurrency test, which need no NATS.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace

import asyncpg

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.profiles import hugepage_profiles

from ..adapters import inventory as inv
from ..domain.placement import (
    BAREMETAL_GPUS,
    HUGEPAGE_FILTERS,
    NODE_LEVEL,
    Choice,
    Request,
    choose,
    clean_node_allowed,
    fabric_manager_note,
    hugepage_note,
    image_gate,
    node_filter,
    partition_summary,
    rank_classes,
    summarize,
    unschedulable_summary,
)

log = get_logger(__name__)


@dataclass(frozen=True)
class PlacementPolicy:
    clean_node_watermark: int = 0
    default_tenant_gpu_quota: int | None = None
    candidate_page: int = 16
    # The fleet's largest PCIe-switch and NUMA slot groups (see `fleet_shape`); None = unknown.
    max_switch_slots: int | None = None
    max_numa_slots: int | None = None
    min_numa_slots: int | None = None
    # The scheduler's `allow_emulated_slots`: whether a lab host's emulated parity report counts as passing.
    allow_emulated_slots: bool = False

    def classes(self, gpus: int) -> list[tuple[bool, int]]:
        return rank_classes(gpus, self.max_switch_slots, self.max_numa_slots, self.min_numa_slots)


@dataclass
class Outcome:
    placed: m.PlacementPlaced | None = None
    unschedulable: m.PlacementUnschedulable | None = None
    already_placed: bool = False
    attempts: int = 0
    skipped_locked: int = 0
    extra: dict = field(default_factory=dict)


async def with_fleet_shape(conn: asyncpg.Connection, policy: PlacementPolicy) -> PlacementPolicy:
    """The policy with the fleet's largest switch and NUMA groups; call again after approvals."""
    switch, max_numa, min_numa = await inv.fleet_shape(conn)
    return replace(policy, max_switch_slots=switch, max_numa_slots=max_numa, min_numa_slots=min_numa)


def request_of(ev: m.AllocationAccepted) -> Request:
    gpus = BAREMETAL_GPUS if ev.shape == "baremetal" else ev.gpu_count
    # A baremetal image is deployed by MAAS with its own driver: no Fabric Manager of ours to match.
    driver = ev.image.driver_version if ev.shape != "baremetal" else None
    return Request(ev.shape, gpus, ev.region, ev.sku, ev.tenant_id, driver_version=driver)


async def place(conn: asyncpg.Connection, ev: m.AllocationAccepted, policy: PlacementPolicy) -> Outcome:
    """Must run inside a transaction; writes nothing when the answer is unschedulable."""
    req = request_of(ev)
    out = Outcome()
    facts = await inv.prelude(
        conn, ev.allocation_id, req.tenant_id, ev.image.slug if req.shape != "baremetal" else None
    )
    if facts.already_placed:
        # A redelivery after a crash between commit and ack: the claims are the answer already given.
        out.already_placed = True
        return out
    limit = policy.default_tenant_gpu_quota if facts.tenant_quota is None else facts.tenant_quota
    if limit is not None:
        used = await inv.tenant_usage_locked(conn, req.tenant_id)
        if used + req.gpus > limit:
            out.unschedulable = m.PlacementUnschedulable(
                allocation_id=ev.allocation_id,
                reason_code="quota_exceeded",
                reason=f"tenant {req.tenant_id} holds {used} of its {limit} GPU quota; {req.gpus} more requested",
                filtered={"quota": 1},
                free_gpus=0,
                requested_gpus=req.gpus,
            )
            return out
    if req.shape == "baremetal":
        await _place_baremetal(conn, ev, req, out)
    else:
        # Only slices boot from the host's image cache; a baremetal image is deployed by MAAS.
        req = replace(req, image_gate=image_gate(ev.image.slug, ev.image.digest_sha256, facts.image_reported))
        await _place_slices(conn, ev, req, policy, out)
    if out.placed is None and not out.already_placed:
        out.unschedulable = await why_not(conn, ev, req, policy)
    return out


async def _place_baremetal(conn: asyncpg.Connection, ev: m.AllocationAccepted, req: Request, out: Outcome) -> None:
    locked: list[str] = []
    for wait, nodes in ((False, await inv.baremetal_candidates(conn, req)), (True, locked)):
        for node_id in list(nodes):
            out.attempts += 1
            got = await inv.try_claim_baremetal(conn, node_id, ev.allocation_id, req.tenant_id, wait=wait)
            if got is inv.LOCKED:
                out.skipped_locked += 1
                locked.append(node_id)
                continue
            if got:
                out.placed = m.PlacementPlaced(
                    allocation_id=ev.allocation_id,
                    node_id=got["node_id"],
                    claim_mode="node_exclusive",
                    fencing_epoch=got["epoch"],
                    maas_system_id=got["maas_system_id"],
                )
                return


async def _place_slices(
    conn: asyncpg.Connection, ev: m.AllocationAccepted, req: Request, policy: PlacementPolicy, out: Outcome
) -> None:
    locked: list[str] = []
    clean_ok: bool | None = None
    seen: set[str] = set()

    def claim_choice(node_id: str, node, free) -> Choice | None:
        choice = choose(free, req.gpus, node["numa_capacity"])
        if choice is None:
            return None
        return choice

    async def commit_choice(node_id: str, node, free, choice: Choice) -> None:
        chosen = {s.slot_id for s in choice.slots}
        after = summarize(
            node_id, [s for s in free if s.slot_id not in chosen], node["total_slots"], 1, node["numa_capacity"]
        )
        epoch, rows = await inv.claim_slots(conn, node_id, ev.allocation_id, req.tenant_id, choice.slots, after)
        out.placed = m.PlacementPlaced(
            allocation_id=ev.allocation_id,
            node_id=node_id,
            claim_mode="slots",
            fencing_epoch=epoch,
            slots=[m.SlotBinding(**{k: r[k] for k in r.keys() if k != "epoch"}) for r in rows],
            nvlink_partition=choice.partition,
        )
        out.extra["tier"] = choice.tier
        if choice.partition is not None:
            out.extra["nvlink_partition"] = choice.partition

    savepoints = itertools.count()

    async def in_savepoint(fn) -> bool:
        # A node looked at but not taken must not stay locked: waiting on another node while holding
        # it is how two workers deadlock. Rolling back to the savepoint releases its row locks. One taken is
        # left open (the transaction's commit ends it): releasing it would cost a round trip per placement.
        name = f"placement_attempt_{next(savepoints)}"
        undo = f"ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}"  # gone, so failed attempts never nest
        await conn.execute(f"SAVEPOINT {name}")
        try:
            ok = await fn()
        except BaseException:
            await conn.execute(undo)
            raise
        if not ok:
            await conn.execute(undo)
        return ok

    async def attempt(node_id: str, wait: bool) -> bool:
        return await in_savepoint(lambda: _attempt(node_id, wait))

    async def _attempt(node_id: str, wait: bool) -> bool:
        out.attempts += 1
        node = await inv.lock_slice_node(
            conn, node_id, wait=wait, gpus=req.gpus, image_gate=req.image_gate, driver_version=req.driver_version
        )
        if node is inv.LOCKED:
            out.skipped_locked += 1
            locked.append(node_id)
            return False
        if node is None:
            return False
        free = await inv.free_slots_locked(conn, node_id)
        choice = claim_choice(node_id, node, free)
        if choice is None:
            return False
        await commit_choice(node_id, node, free, choice)
        return True

    async def clean_allowed() -> bool:
        nonlocal clean_ok
        if not policy.clean_node_watermark:
            return True
        if clean_ok is None:
            # One decision per request, serialised per region/SKU so two workers cannot both
            # break the last clean host above the watermark.
            await inv.lock_clean_watermark(conn, req.region, req.sku)
            clean_ok = clean_node_allowed(await inv.count_clean_nodes(conn, req), policy.clean_node_watermark)
        return clean_ok

    # Fast path: per rank class, the best node nobody holds, found and locked in one statement.
    for sliced, tier in policy.classes(req.gpus):
        if not sliced and not await clean_allowed():
            break
        out.attempts += 1
        outcome: dict[str, bool] = {}

        async def fast(sliced: bool = sliced, tier: int = tier, outcome: dict[str, bool] = outcome) -> bool:
            got = await inv.lock_best_in_class(conn, req, sliced, tier)
            if got is None:
                outcome["empty"] = True
                return False
            node, free = got
            choice = claim_choice(node["node_id"], node, free)
            if choice is None:
                return False
            await commit_choice(node["node_id"], node, free, choice)
            return True

        if await in_savepoint(fast):
            return
        if outcome.get("empty"):
            continue
        # The summary was stale (or slots were held): the exhaustive path below decides.
        break

    async for cand in inv.slice_candidates(conn, req, rank_classes(req.gpus), policy.candidate_page):
        if cand.node_id in seen:
            continue
        seen.add(cand.node_id)
        if not cand.sliced and not await clean_allowed():
            break
        if await attempt(cand.node_id, wait=False):
            return
    # Nodes another worker held: wait for them rather than answer "unschedulable" on contention.
    for node_id in locked[:]:
        if await attempt(node_id, wait=True):
            return


async def why_not(
    conn: asyncpg.Connection, ev: m.AllocationAccepted, req: Request, policy: PlacementPolicy
) -> m.PlacementUnschedulable:
    """Every node lands in exactly one bucket: the first filter it fails (or `clean_node_reserve`)."""
    facts = await inv.node_facts(conn, req.image_gate)
    filtered: Counter[str] = Counter()
    free = eligible = largest = 0
    short_of_pages = []
    other_fabric_manager = []
    partitioned: list = []
    unpartitioned_free = 0
    for node in facts:
        reason = node_filter(node, req)
        if reason in HUGEPAGE_FILTERS:
            short_of_pages.append(node)
        if reason == "fabric_manager_version":
            other_fabric_manager.append(node)
        # A baremetal host in use is capacity taken, not an ineligible host.
        if reason is not None and reason in NODE_LEVEL and not (req.shape == "baremetal" and reason == "in_use"):
            filtered[reason] += 1
            continue
        eligible += 1
        if req.shape == "baremetal":
            # Passed every filter yet was not claimed: a concurrent transaction's claim holds it.
            filtered["in_use"] += 1
            continue
        free += node.candidate.free_slots
        largest = max(largest, node.candidate.free_slots)
        if node.partitioned:
            partitioned.append(node)
        else:
            unpartitioned_free += node.candidate.free_slots
        if reason is not None:
            filtered[reason] += 1
        elif not node.candidate.sliced and policy.clean_node_watermark:
            filtered["clean_node_reserve"] += 1
        else:
            filtered["in_use"] += 1
    code, text = unschedulable_summary(filtered, free, req.gpus, req.shape, eligible, largest)
    if code in ("no_partition", "topology", "fragmented") and partitioned and not unpartitioned_free:
        # Every free GPU is on a partitioned host: say which partitions are missing and what holds them.
        code, text = partition_summary(partitioned, req.gpus, filtered) or (code, text)
    text += hugepage_note(short_of_pages, hugepage_profiles())
    text += fabric_manager_note(other_fabric_manager, req.driver_version)
    return m.PlacementUnschedulable(
        allocation_id=ev.allocation_id,
        reason_code=code,
        reason=text[:2048],
        filtered=dict(filtered),
        free_gpus=free,
        requested_gpus=req.gpus,
    )
