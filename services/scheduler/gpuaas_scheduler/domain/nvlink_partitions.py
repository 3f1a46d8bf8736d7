"""NVLink partitions of an HGX H200 board in shared-NVSwitch mode, and how slices are packed on them.

Fabric Manager activates only fifteen fixed GPU sets (by GPU *module ID*, 1-8, not PCI order): the whole
board, its two halves (one per CPU socket), four pairs and the eight single GPUs. A multi-GPU slice gets full
NVLink bandwidth only when its GPUs are exactly one of these sets, so `{1, 2}` is never a slice even though
both GPUs sit on one socket. Fabric Manager lists every partition whatever the health of its GPUs, so the
scheduler itself drops the partitions that hold a degraded, excluded or unreported GPU.

Packing follows buddy order: a placement uses up every available partition it overlaps, so the best one
overlaps the fewest large ones (finish a broken pair before breaking a whole one, a tenanted half before
opening an empty one, a sliced host before a clean one). Large partitions then stay free the longest for the
4- and 8-GPU slices and the baremetal hosts that need them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MODULE_IDS: tuple[int, ...] = tuple(range(1, 9))
SIZES: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True)
class Partition:
    partition_id: int
    modules: frozenset[int]

    @property
    def size(self) -> int:
        return len(self.modules)


def _partition(pid: int, *modules: int) -> Partition:
    return Partition(pid, frozenset(modules))


# Fabric Manager's default partition ids for HGX H100/H200; the agent activates by this id.
PARTITIONS: tuple[Partition, ...] = (
    _partition(0, *MODULE_IDS),
    _partition(1, 1, 2, 3, 4),
    _partition(2, 5, 6, 7, 8),
    _partition(3, 1, 3),
    _partition(4, 2, 4),
    _partition(5, 5, 7),
    _partition(6, 6, 8),
    *(_partition(6 + m, m) for m in MODULE_IDS),
)
BY_ID: dict[int, Partition] = {p.partition_id: p for p in PARTITIONS}
_BY_MODULES: dict[frozenset[int], Partition] = {p.modules: p for p in PARTITIONS}
_BY_SIZE: dict[int, tuple[Partition, ...]] = {n: tuple(p for p in PARTITIONS if p.size == n) for n in SIZES}
# The larger partitions (sizes 8, 4, 2) that a placement can break, largest first: the buddy score's order.
_BLOCK_SIZES: tuple[int, ...] = (8, 4, 2)
_BLOCK_NOUN: dict[int, tuple[str, str]] = {8: ("host", "hosts"), 4: ("half", "halves"), 2: ("pair", "pairs")}


@dataclass(frozen=True)
class GpuState:
    """One GPU of a host as placement sees it. A held GPU may also be degraded: both are kept so that the
    why-not answer can say which one blocks a partition."""

    free: bool = True
    healthy: bool = True
    excluded: bool = False

    @property
    def available(self) -> bool:
        return self.free and self.healthy and not self.excluded


Host = Mapping[int, GpuState]


def partition_for(modules: Iterable[int]) -> Partition | None:
    """The partition made of exactly these module IDs, or None (`{1, 2}`, any 3-GPU set, ...)."""
    return _BY_MODULES.get(frozenset(modules))


def available_modules(gpus: Host) -> frozenset[int]:
    # A module the host did not report is as unusable as an excluded one.
    return frozenset(m for m, g in gpus.items() if m in MODULE_IDS and g.available)


def available_partitions(gpus: Host) -> list[Partition]:
    """Every partition whose GPUs are all free and healthy, in partition-id order."""
    avail = available_modules(gpus)
    return [p for p in PARTITIONS if p.modules <= avail]


def feasible_partitions(gpus: Host, count: int) -> list[Partition]:
    """The partitions that could take a `count`-GPU slice now; none for a size no partition has."""
    avail = available_modules(gpus)
    return [p for p in _BY_SIZE.get(count, ()) if p.modules <= avail]


def overlapping(partition: Partition, active: Iterable[Partition]) -> list[Partition]:
    """The active partitions sharing a GPU with `partition`: Fabric Manager would answer FM_ST_IN_USE."""
    return [a for a in active if a.modules & partition.modules]


def _enclosing(partition: Partition, size: int) -> Partition:
    return next(p for p in _BY_SIZE[size] if partition.modules <= p.modules)


def buddy_score(gpus: Host, partition: Partition, tenants: int = 0) -> tuple[int, ...]:
    """Lower is better; comparable across hosts (`tenants`: the live slices on the host).

    1. How many available hosts, halves and pairs the placement breaks, largest first: a broken pair's
       free mate beats a whole pair, a whole pair in a tenanted half beats an empty half, and so on.
    2. The most tenants first. Lifetimes are unknown and close to memoryless, so one more tenant delays a
       host with k of them from draining back to clean by about a lifetime / (k + 1): a busy host absorbs a
       new slice at the least cost to the hosts that baremetal and 8-GPU slices will need.
    3. Free GPUs left in the partition's half: the half that already has tenants.
    4. Free GPUs left on the host: the fullest host.
    5. Partition id, for a deterministic answer.

    2 and 3 before 4 measured better in bench/packing.py (0.3 and 0.2 points of GPU-hours over five seeds).
    """
    avail = available_modules(gpus)
    broken = [sum(1 for q in _BY_SIZE[n] if q.modules <= avail and q.modules & partition.modules) for n in _BLOCK_SIZES]
    half_left = len((_enclosing(partition, 4).modules if partition.size <= 4 else partition.modules) & avail)
    left = len(avail) - partition.size
    return (*broken, -tenants, half_left - partition.size, left, partition.partition_id)


def best_partition(gpus: Host, count: int) -> Partition | None:
    """The host's best partition for a `count`-GPU slice in buddy order, or None."""
    feasible = feasible_partitions(gpus, count)
    return min(feasible, key=lambda p: buddy_score(gpus, p)) if feasible else None


def best_placement(
    hosts: Mapping[str, Host], count: int, tenants: Mapping[str, int] | None = None
) -> tuple[str, Partition] | None:
    """The fleet's best (host, partition) for a `count`-GPU slice in buddy order, ties to the lowest host id."""
    live = tenants or {}
    best: tuple[tuple[int, ...], str, Partition] | None = None
    for host_id, gpus in hosts.items():
        for p in feasible_partitions(gpus, count):
            key = buddy_score(gpus, p, live.get(host_id, 0))
            if best is None or (key, host_id) < best[:2]:
                best = (key, host_id, p)
    return (best[1], best[2]) if best else None


# --- why not --------------------------------------------------------------------------------------


def why_not(hosts: Mapping[str, Host], count: int) -> tuple[str, str] | None:
    """A reason code and a sentence in partition terms when no host has a `count`-GPU partition, else None.

    A partition blocked by both a tenant and a sick GPU counts as blocked by health: freeing the tenant would
    not free it."""
    if count not in SIZES:
        return "unsupported_size", f"no {count}-GPU partition exists: a slice has 1, 2, 4 or 8 GPUs"
    free = sum(len(available_modules(g)) for g in hosts.values())
    short = _short_of_gpus(free, count)
    if short is not None:
        return short
    blocked = _blocked_partitions(hosts, count)
    if blocked is None:
        return None
    return "no_partition", f"{free} GPUs free, no free {count}-GPU partition: {_blocked_by(count, *blocked)}"


def _short_of_gpus(free: int, count: int) -> tuple[str, str] | None:
    """Too few GPUs free anywhere, whatever the partitions."""
    if free == 0:
        return "no_capacity", f"no GPU is free; {count} requested"
    if free < count:
        return "insufficient_capacity", f"{free} GPUs free, {count} requested"
    return None


def _blocked_partitions(hosts: Mapping[str, Host], count: int) -> tuple[int, int] | None:
    """The `count`-GPU partitions blocked by a tenant only and those blocked by health; None: one is free."""
    tenant = health = 0
    for gpus in hosts.values():
        usable = frozenset(m for m, g in gpus.items() if g.healthy and not g.excluded)
        avail = available_modules(gpus)
        for p in _BY_SIZE[count]:
            if p.modules <= avail:
                return None
            if p.modules <= usable:
                tenant += 1
            else:
                health += 1
    return tenant, health


def _blocked_by(count: int, tenant: int, health: int) -> str:
    one, many = _BLOCK_NOUN[count]
    sick = "a degraded or excluded GPU"
    if health == 0:
        return f"every {one} has a tenant"
    if tenant == 0:
        return f"every {one} has {sick}"
    return f"{tenant} {many if tenant > 1 else one} {'have' if tenant > 1 else 'has'} a tenant, {health} {sick}"
