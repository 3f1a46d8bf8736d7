"""Place one accepted allocation inside the caller's transaction: quota, candidates in rank order,
node lock with SKIP LOCKED and fallback, claims; or a complete why-not answer.

Called by the bus handler (with the inbox row and the outbox in the same transaction) and directly by
the benchmark and the concurrency test, which need no NATS.
"""

from __future__ import annotations

import enum
import itertools
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar

import asyncpg

from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.profiles import hugepage_profiles

from ..adapters import inventory as inv
from ..domain.placement import (
    BAREMETAL_GPUS,
    HUGEPAGE_FILTERS,
    NODE_LEVEL,
    NodeCandidate,
    Request,
    SlotView,
    clean_node_allowed,
    fabric_manager_note,
    hugepage_note,
    image_gate,
    node_filter,
    partition_summary,
    pick_slots,
    rank_classes,
    unschedulable_summary,
)

log = get_logger(__name__)
T = TypeVar("T")


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


@dataclass(frozen=True)
class SearchContext:
    """What placement knows about one request before it looks at any node, gathered once per request (as
    OpenStack Placement's research context gathers a request's facts before it queries providers) and read,
    never recomputed, by every step of the search and by the why-not answer:

    - `req`: the request as the filters see it (shape, GPUs, region, SKU, tenant, driver), with the image
      cache gate already decided (`image_gate`: only slices boot from the host's cache, and only for an
      image some host has reported);
    - `fast_classes`: the (sliced, tier) rank classes the fast path tries, without the tiers no host of the
      fleet can reach (`PlacementPolicy.classes`);
    - `walk_classes`: every rank class, in score order, for the exhaustive walk;
    - `candidate_page`: how many candidates the walk reads per round trip;
    - `clean_node_watermark`: how many clean hosts must stay whole (0: slicing a clean host is always allowed).
    """

    allocation_id: uuid.UUID
    req: Request
    fast_classes: tuple[tuple[bool, int], ...]
    walk_classes: tuple[tuple[bool, int], ...]
    candidate_page: int
    clean_node_watermark: int

    @classmethod
    def gather(cls, ev: m.AllocationAccepted, req: Request, policy: PlacementPolicy) -> SearchContext:
        return cls(
            ev.allocation_id,
            req,
            tuple(policy.classes(req.gpus)),
            tuple(rank_classes(req.gpus)),
            policy.candidate_page,
            policy.clean_node_watermark,
        )


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
    out.unschedulable = await _over_quota(conn, ev, req, policy, facts)
    if out.unschedulable is not None:
        return out
    if req.shape == "baremetal":
        await BaremetalSearch(conn, SearchContext.gather(ev, req, policy), out).run()
    else:
        # Only slices boot from the host's image cache; a baremetal image is deployed by MAAS.
        req = replace(req, image_gate=image_gate(ev.image.slug, ev.image.digest_sha256, facts.image_reported))
        search = SearchContext.gather(ev, req, policy)
        await SliceSearch(conn, search, out).run()
        if out.placed is None:
            answer = await why_not(conn, ev, req, policy)
            if not answer.filtered.get("in_use"):
                out.unschedulable = answer
                return out
            # A host passes every rule now yet was not taken: what the search found there has changed since (a
            # release committed after the walk, or placements that held it then have ended). Once more, with what
            # is there now; a refusal must hold.
            await SliceSearch(conn, search, out).run()
    if out.placed is None:
        out.unschedulable = await why_not(conn, ev, req, policy)
    return out


async def _over_quota(
    conn: asyncpg.Connection, ev: m.AllocationAccepted, req: Request, policy: PlacementPolicy, facts: inv.Prelude
) -> m.PlacementUnschedulable | None:
    """The answer when the tenant's GPU quota cannot take the request, else None (the tenant's usage stays
    locked for the rest of the transaction, so two concurrent claims cannot both pass)."""
    limit = policy.default_tenant_gpu_quota if facts.tenant_quota is None else facts.tenant_quota
    if limit is None:
        return None
    used = await inv.tenant_usage_locked(conn, req.tenant_id)
    if used + req.gpus <= limit:
        return None
    return m.PlacementUnschedulable(
        allocation_id=ev.allocation_id,
        reason_code="quota_exceeded",
        reason=f"tenant {req.tenant_id} holds {used} of its {limit} GPU quota; {req.gpus} more requested",
        filtered={"quota": 1},
        free_gpus=0,
        requested_gpus=req.gpus,
    )


class BaremetalSearch:
    """A whole host for a baremetal request: the candidates in order, each tried without waiting; then the
    ones another worker held, waited for."""

    def __init__(self, conn: asyncpg.Connection, ctx: SearchContext, out: Outcome) -> None:
        self.conn, self.ctx, self.out = conn, ctx, out
        self.locked: list[str] = []

    async def run(self) -> None:
        for node_id in await inv.baremetal_candidates(self.conn, self.ctx.req):
            if await self.try_node(node_id, wait=False):
                return
        for node_id in list(self.locked):
            if await self.try_node(node_id, wait=True):
                return

    async def try_node(self, node_id: str, *, wait: bool) -> bool:
        self.out.attempts += 1
        ctx = self.ctx
        got = await inv.try_claim_baremetal(self.conn, node_id, ctx.allocation_id, ctx.req.tenant_id, wait=wait)
        if got is inv.LOCKED:
            self.out.skipped_locked += 1
            self.locked.append(node_id)
            return False
        if not got:
            return False
        self.out.placed = m.PlacementPlaced(
            allocation_id=ctx.allocation_id,
            node_id=got["node_id"],
            claim_mode="node_exclusive",
            fencing_epoch=got["epoch"],
            maas_system_id=got["maas_system_id"],
            wipe_policy=got["wipe_policy"],
        )
        return True


class FastTry(enum.Enum):
    """How one rank class of the fast path ended."""

    TAKEN = "taken"  # its best free node took the request
    EMPTY = "empty"  # no node of the class is free: try the next class
    STALE = "stale"  # its best node's summary promised a group its slots do not hold: the walk decides

    def taken(self) -> bool:
        return self is FastTry.TAKEN


class SliceSearch:
    """A slot group for a slice, in three named steps, each ending the search once a node takes it:

    1. `fast_path`: per rank class, the best node nobody holds, found and locked in one statement;
    2. `walk_candidates`: every candidate in rank order, a page at a time, each node tried without waiting;
    3. `wait_for_held`: the nodes another worker held during the walk, waited for rather than answering
       "unschedulable" on contention.

    Every try runs in a savepoint of its own (`_in_savepoint`), so a node looked at but not taken is never
    left locked. Slicing a clean host is decided once per request (`_clean_allowed`)."""

    def __init__(self, conn: asyncpg.Connection, ctx: SearchContext, out: Outcome) -> None:
        self.conn, self.ctx, self.out = conn, ctx, out
        self.locked: list[str] = []  # nodes another worker held when tried without waiting
        self._clean_ok: bool | None = None
        self._savepoints = itertools.count()

    async def run(self) -> None:
        if await self.fast_path():
            return
        if await self.walk_candidates():
            return
        await self.wait_for_held()

    async def fast_path(self) -> bool:
        for sliced, tier in self.ctx.fast_classes:
            if not sliced and not await self._clean_allowed():
                return False
            self.out.attempts += 1
            ended = await self._in_savepoint(partial(self._best_in_class, sliced, tier), FastTry.taken)
            if ended is FastTry.TAKEN:
                return True
            if ended is FastTry.STALE:
                return False  # the summary was stale (or slots were held): the walk decides
        return False

    async def walk_candidates(self) -> bool:
        seen: set[str] = set()
        req, classes = self.ctx.req, self.ctx.walk_classes
        ended = await self._walk(inv.slice_candidates(self.conn, req, classes, self.ctx.candidate_page), seen)
        # The pages were read a statement each, each with a snapshot of its own: a host that moved past them (a
        # clean host sliced meanwhile goes to a class already read) is in none. Until one snapshot shows no
        # candidate the walk has not seen, the ones it missed are walked too: each round sees one more host at
        # least, so the rounds end.
        while ended is None:
            missed = await inv.missed_slice_candidates(self.conn, req, classes, seen)
            if not missed:
                return False
            ended = await self._walk(_listed(missed), seen)
        return ended

    async def _walk(self, candidates: AsyncIterator[NodeCandidate], seen: set[str]) -> bool | None:
        """Each candidate not seen yet, tried without waiting: True when one took the request, False when the
        walk must stop (the clean-host watermark: every candidate after a clean one is clean), None when the
        candidates ran out."""
        async for cand in candidates:
            if cand.node_id in seen:
                continue
            seen.add(cand.node_id)
            if not cand.sliced and not await self._clean_allowed():
                return False
            if await self._in_savepoint(partial(self._try_node, cand.node_id, wait=False)):
                return True
        return None

    async def wait_for_held(self) -> bool:
        for node_id in list(self.locked):
            if await self._in_savepoint(partial(self._try_node, node_id, wait=True)):
                return True
        return False

    # --- one try -------------------------------------------------------------------------------------

    async def _best_in_class(self, sliced: bool, tier: int) -> FastTry:
        got = await inv.lock_best_in_class(self.conn, self.ctx.req, sliced, tier)
        if got is None:
            return FastTry.EMPTY
        node, free = got
        return FastTry.TAKEN if await self._take(node["node_id"], node, free) else FastTry.STALE

    async def _try_node(self, node_id: str, *, wait: bool) -> bool:
        self.out.attempts += 1
        req = self.ctx.req
        node = await inv.lock_slice_node(
            self.conn, node_id, wait=wait, gpus=req.gpus, image_gate=req.image_gate, driver_version=req.driver_version
        )
        if node is inv.LOCKED:
            self.out.skipped_locked += 1
            self.locked.append(node_id)
            return False
        if node is None:
            return False
        return await self._take(node_id, node, await inv.free_slots_locked(self.conn, node_id))

    async def _take(self, node_id: str, node: asyncpg.Record, free: list[SlotView]) -> bool:
        """Claim the node's best group of its locked free slots; False when it has none for the request."""
        ctx = self.ctx
        pick = pick_slots(node_id, free, ctx.req.gpus, node["total_slots"], node["numa_capacity"])
        if pick is None:
            return False
        # The pick is all the claim reads of the search (slots, summary after), so a Host aggregate's `reserve`
        # can take it unchanged.
        epoch, rows = await inv.claim_slots(
            self.conn, node_id, ctx.allocation_id, ctx.req.tenant_id, pick.slots, pick.after
        )
        choice = pick.choice
        self.out.placed = m.PlacementPlaced(
            allocation_id=ctx.allocation_id,
            node_id=node_id,
            claim_mode="slots",
            fencing_epoch=epoch,
            slots=[m.SlotBinding(**{k: r[k] for k in r.keys() if k != "epoch"}) for r in rows],
            nvlink_partition=choice.partition,
        )
        self.out.extra["tier"] = choice.tier
        if choice.partition is not None:
            self.out.extra["nvlink_partition"] = choice.partition
        return True

    # --- shared by the steps -------------------------------------------------------------------------

    async def _in_savepoint(self, attempt: Callable[[], Awaitable[T]], taken: Callable[[T], bool] = bool) -> T:
        """Run one try in a savepoint of its own; kept when `taken(result)`, else rolled back and released.

        A node looked at but not taken must not stay locked: waiting on another node while holding
        it is how two workers deadlock. Rolling back to the savepoint releases its row locks. One taken is
        left open (the transaction's commit ends it): releasing it would cost a round trip per placement."""
        name = f"placement_attempt_{next(self._savepoints)}"
        undo = f"ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}"  # gone, so failed attempts never nest
        await self.conn.execute(f"SAVEPOINT {name}")
        try:
            result = await attempt()
        except BaseException:
            await self.conn.execute(undo)
            raise
        if not taken(result):
            await self.conn.execute(undo)
        return result

    async def _clean_allowed(self) -> bool:
        if not self.ctx.clean_node_watermark:
            return True
        if self._clean_ok is None:
            # One decision per request, serialised per region/SKU so two workers cannot both
            # break the last clean host above the watermark.
            req = self.ctx.req
            await inv.lock_clean_watermark(self.conn, req.region, req.sku)
            clean = await inv.count_clean_nodes(self.conn, req)
            self._clean_ok = clean_node_allowed(clean, self.ctx.clean_node_watermark)
        return self._clean_ok


async def _listed(candidates: list[NodeCandidate]) -> AsyncIterator[NodeCandidate]:
    for cand in candidates:
        yield cand


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
