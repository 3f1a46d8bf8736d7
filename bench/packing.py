"""Packing quality on a seeded synthetic trace: the scheduler's scorer and buddy-order partition packing
against first-fit and random, with an offline upper bound. Pure Python over the scheduler's pure domain
functions (no database).

    .venv/bin/python bench/packing.py [--json] [--nodes 64] [--hours 400] [--load 0.9] [--seed 1] [--seeds 1]

Hosts are convertible (both MAAS profile tags): a clean host can go baremetal, any host can be sliced.
Requests (1-, 2-, 4- and 8-GPU slices, baremetal hosts) arrive as a Poisson process with exponential
lifetimes; a refused request is lost. Every policy runs twice: free-form (any free GPUs of one host) and
under the NVLink partition rules of an HGX H200 in shared-NVSwitch mode (a slice's GPUs are exactly one of
the fifteen partitions, see gpuaas_scheduler.domain.nvlink_partitions). Under the rules every slot carries its
GPU module ID, as on a host whose discovery mapped them, so the scorer runs the scheduler's own partition path
(the partition summary that ranks the host, buddy order inside it); free-form slots carry none, the path of a
host without module IDs (PCIe switch and NUMA rules).
Metrics: acceptance per shape, GPU-hours served and their share of the upper bound, and fragmentation
(time-averaged share of free GPUs that sit on partly used hosts, where no baremetal request can use them).
Upper bound: GPU-hours no policy can beat, the fluid bound integral of min(offered GPUs alive, capacity).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import defaultdict
from collections.abc import Callable

from gpuaas_scheduler.domain.nvlink_partitions import (
    GpuState,
    Partition,
    best_placement,
    feasible_partitions,
    partition_for,
)
from gpuaas_scheduler.domain.placement import SlotView, choose, rank_nodes, summarize

SLOTS = 8
SHAPES = (("slice1", 1, 0.40), ("slice2", 2, 0.20), ("slice4", 4, 0.15), ("slice8", 8, 0.07), ("baremetal", 8, 0.18))
# Slot i in PCI-address order holds this GPU module. On a real HGX H200 the NVLink pairs sit behind one PCIe
# switch (buses 0f/10 are modules 5/7, 86/87 are 1/3, ...), so the scorer's switch pairs are the valid pairs.
MODULE_OF_SLOT = (1, 3, 2, 4, 5, 7, 6, 8)
SLOT_OF_MODULE = {m: i for i, m in enumerate(MODULE_OF_SLOT)}
FREE, HELD = GpuState(), GpuState(free=False)

Placement = tuple[str | None, list[SlotView] | None]


def topology(node: str, modules: bool = False) -> list[SlotView]:
    return [
        SlotView(f"{node}-s{i}", 0 if i < 4 else 1, f"sw{i // 2}", f"vf{i}", MODULE_OF_SLOT[i] if modules else None)
        for i in range(SLOTS)
    ]


def slot_index_of(slot_id: str) -> int:
    return int(slot_id.rsplit("-s", 1)[1])


def slot_index(slot: SlotView) -> int:
    return slot_index_of(slot.slot_id)


class Cluster:
    def __init__(self, nodes: int, modules: bool = False) -> None:
        self.nodes = [f"n{i:03d}" for i in range(nodes)]
        self.slots = {n: topology(n, modules) for n in self.nodes}
        self.free = {n: {s.slot_id: s for s in self.slots[n]} for n in self.nodes}
        # The same occupancy by module ID, kept in step with `free` for the partition functions.
        self.gpus = {n: dict.fromkeys(MODULE_OF_SLOT, FREE) for n in self.nodes}
        self.baremetal: set[str] = set()
        self.live: dict[str, int] = defaultdict(int)

    def clean(self, n: str) -> bool:
        return n not in self.baremetal and len(self.free[n]) == SLOTS

    def sliceable(self) -> list[str]:
        return [n for n in self.nodes if n not in self.baremetal]

    def candidates(self):
        return [summarize(n, self.free[n].values(), SLOTS, self.live[n], 4) for n in self.sliceable()]

    def slots_of(self, n: str, p: Partition) -> list[SlotView]:
        return [self.slots[n][SLOT_OF_MODULE[m]] for m in sorted(p.modules)]

    def take(self, n: str, slots: list[SlotView]) -> None:
        for s in slots:
            del self.free[n][s.slot_id]  # a KeyError here is a double booking
            self.gpus[n][MODULE_OF_SLOT[slot_index(s)]] = HELD

    def give_back(self, n: str, slot_ids: list[str]) -> None:
        for sid in slot_ids:
            slot = self.slots[n][slot_index_of(sid)]
            self.free[n][sid] = slot
            self.gpus[n][MODULE_OF_SLOT[slot_index(slot)]] = FREE


def first_clean(c: Cluster) -> Placement:
    return next((n for n in c.nodes if c.clean(n)), None), None


def place_scored(c: Cluster, shape: str, gpus: int, rules: bool, rng: random.Random) -> Placement:
    # The scheduler's ranking and choice. Under the rules the slots carry module IDs, so `choose` takes the
    # host's best partition itself; the partition check is only a guard.
    if shape == "baremetal":
        return first_clean(c)
    for cand in rank_nodes(c.candidates(), gpus):
        choice = choose(c.free[cand.node_id].values(), gpus, 4)
        if not choice:
            continue
        if rules and partition_for(MODULE_OF_SLOT[slot_index(s)] for s in choice.slots) is None:
            continue
        return cand.node_id, list(choice.slots)
    return None, None


def place_first_fit(c: Cluster, shape: str, gpus: int, rules: bool, rng: random.Random) -> Placement:
    # Kubernetes-DRA-like: the first node (by name) with enough free devices, the lowest device indexes on it;
    # under the rules, its partition with the lowest device indexes (PCI order fills pair after pair).
    if shape == "baremetal":
        return first_clean(c)
    for n in c.sliceable():
        if rules:
            parts = feasible_partitions(c.gpus[n], gpus)
            if parts:
                return n, min((c.slots_of(n, p) for p in parts), key=lambda ss: [slot_index(s) for s in ss])
        elif len(c.free[n]) >= gpus:
            return n, sorted(c.free[n].values(), key=slot_index)[:gpus]
    return None, None


def place_random(c: Cluster, shape: str, gpus: int, rules: bool, rng: random.Random) -> Placement:
    if shape == "baremetal":
        clean = [n for n in c.nodes if c.clean(n)]
        return (rng.choice(clean) if clean else None), None
    if rules:
        fits = [(n, p) for n in c.sliceable() for p in feasible_partitions(c.gpus[n], gpus)]
        if not fits:
            return None, None
        n, p = rng.choice(fits)
        return n, c.slots_of(n, p)
    nodes = [n for n in c.sliceable() if len(c.free[n]) >= gpus]
    if not nodes:
        return None, None
    n = rng.choice(nodes)
    return n, rng.sample(sorted(c.free[n].values(), key=slot_index), gpus)


def place_buddy(c: Cluster, shape: str, gpus: int, rules: bool, rng: random.Random) -> Placement:
    # Always places on partitions, so it is the same policy with and without the rules.
    if shape == "baremetal":
        return first_clean(c)
    best = best_placement({n: c.gpus[n] for n in c.sliceable()}, gpus, c.live)
    return (best[0], c.slots_of(*best)) if best else (None, None)


POLICIES: dict[str, Callable[[Cluster, str, int, bool, random.Random], Placement]] = {
    "scorer": place_scored,
    "buddy": place_buddy,
    "first_fit": place_first_fit,
    "random": place_random,
}


def trace(seed: int, nodes: int, hours: float, load: float) -> list[tuple[float, float, str, int]]:
    rng = random.Random(seed)
    mean_gpus = sum(g * w for _, g, w in SHAPES) / sum(w for *_, w in SHAPES)
    mean_life = 8.0
    rate = load * nodes * SLOTS / (mean_gpus * mean_life)
    t, out = 0.0, []
    names, weights = [s[0] for s in SHAPES], [s[2] for s in SHAPES]
    gpus_of = {s[0]: s[1] for s in SHAPES}
    while t < hours:
        t += rng.expovariate(rate)
        shape = rng.choices(names, weights)[0]
        out.append((t, rng.expovariate(1 / mean_life), shape, gpus_of[shape]))
    return out


def simulate(policy: str, events, nodes: int, seed: int, rules: bool) -> dict:
    rng = random.Random(seed)
    c = Cluster(nodes, modules=rules)
    departures: list[tuple[float, int, str, list[str]]] = []
    offered: dict[str, int] = defaultdict(int)
    accepted: dict[str, int] = defaultdict(int)
    gpu_hours = 0.0
    frag_area = free_area = 0.0
    last = 0.0
    for i, (t, life, shape, gpus) in enumerate(events):
        while departures and departures[0][0] <= t:
            _, _, node, slot_ids = heapq.heappop(departures)
            if slot_ids:
                c.give_back(node, slot_ids)
            else:
                c.baremetal.discard(node)
            c.live[node] -= 1
        dt = t - last
        free_total = sum(len(f) for n, f in c.free.items() if n not in c.baremetal)
        stranded = sum(len(f) for n, f in c.free.items() if n not in c.baremetal and len(f) < SLOTS)
        frag_area += stranded * dt
        free_area += free_total * dt
        last = t
        offered[shape] += 1
        node, slots = POLICIES[policy](c, shape, gpus, rules, rng)
        if node is None:
            continue
        accepted[shape] += 1
        gpu_hours += gpus * life
        c.live[node] += 1
        if shape == "baremetal":
            c.baremetal.add(node)
            heapq.heappush(departures, (t + life, i, node, []))
        else:
            assert slots is not None and len(slots) == gpus
            if rules and partition_for(MODULE_OF_SLOT[slot_index(s)] for s in slots) is None:
                raise AssertionError(f"{policy} placed {gpus} GPUs off the partitions on {node}")
            c.take(node, slots)
            heapq.heappush(departures, (t + life, i, node, [s.slot_id for s in slots]))
    return {
        "acceptance": {k: round(accepted[k] / offered[k], 4) for k in sorted(offered)},
        "acceptance_all": round(sum(accepted.values()) / max(1, sum(offered.values())), 4),
        "gpu_hours": round(gpu_hours, 1),
        "fragmentation": round(frag_area / free_area, 4) if free_area else 0.0,
    }


def fluid_upper_bound(events, nodes: int) -> float:
    """GPU-hours served can never exceed the integral of min(GPUs of all offered requests alive, capacity)."""
    points = sorted([(t, g) for t, life, _, g in events] + [(t + life, -g) for t, life, _, g in events])
    cap, alive, last, area = nodes * SLOTS, 0, 0.0, 0.0
    for t, delta in points:
        area += min(alive, cap) * (t - last)
        alive += delta
        last = t
    return round(area, 1)


def repacking_reference(events, nodes: int) -> float:
    """GPU-hours of greedy admission on a fleet that live-migrates for free after every departure.

    Slices of 1, 2 and 4 GPUs then always fill ceil(their GPUs / 8) hosts (power-of-two partitions pack
    without holes), and an 8-GPU request is refused only when no host is left after them. Not a bound (an
    admission policy that refuses small slices could beat it), but placement without migration can hardly
    do better: the headroom that packing, as opposed to the trace, leaves to a placement policy."""
    whole = small = 0
    departures: list[tuple[float, int]] = []
    served = 0.0
    for t, life, _, gpus in events:
        while departures and departures[0][0] <= t:
            _, g = heapq.heappop(departures)
            whole, small = (whole - 1, small) if g == SLOTS else (whole, small - g)
        after = (whole + 1, small) if gpus == SLOTS else (whole, small + gpus)
        if after[0] + -(-after[1] // SLOTS) <= nodes:
            whole, small = after
            served += gpus * life
            heapq.heappush(departures, (t + life, gpus))
    return round(served, 1)


def points(a: float, b: float) -> float:
    return round(100 * (a - b), 1)


def run(nodes: int, hours: float, load: float, seed: int) -> dict:
    events = trace(seed, nodes, hours, load)
    # GPU-hours of requests that ended inside the horizon can run past it; the bound uses the same accounting.
    bound = fluid_upper_bound(events, nodes)
    out: dict = {"nodes": nodes, "hours": hours, "load": load, "seed": seed, "requests": len(events)}
    out["upper_bound_gpu_hours"] = bound
    reference = repacking_reference(events, nodes)
    out["repacking_reference"] = {"gpu_hours": reference, "share_of_bound": round(reference / bound, 4)}
    for rules, key in ((False, "free_form"), (True, "partitions")):
        table = {name: simulate(name, events, nodes, seed, rules) for name in POLICIES}
        for r in table.values():
            r["share_of_bound"] = round(r["gpu_hours"] / bound, 4)
        ff = table["first_fit"]["acceptance"]
        for name in ("scorer", "buddy"):
            acc = table[name]["acceptance"]
            table[name]["vs_first_fit_points"] = {k: points(acc[k], ff[k]) for k in ("slice4", "slice8", "baremetal")}
        out[key] = table
    return out


def mean_of(runs: list[dict]) -> dict:
    """Per rule set and policy, the seeds' mean share of the bound and acceptance per shape."""
    out: dict = {
        "repacking_reference": round(sum(r["repacking_reference"]["share_of_bound"] for r in runs) / len(runs), 4)
    }
    for key in ("free_form", "partitions"):
        out[key] = {}
        for name in POLICIES:
            rows = [r[key][name] for r in runs]
            out[key][name] = {
                "share_of_bound": round(sum(x["share_of_bound"] for x in rows) / len(rows), 4),
                "acceptance": {
                    s: round(sum(x["acceptance"][s] for x in rows) / len(rows), 4) for s in rows[0]["acceptance"]
                },
                "fragmentation": round(sum(x["fragmentation"] for x in rows) / len(rows), 4),
            }
        ff = out[key]["first_fit"]["acceptance"]
        for name in ("scorer", "buddy"):
            acc = out[key][name]["acceptance"]
            out[key][name]["vs_first_fit_points"] = {
                k: points(acc[k], ff[k]) for k in ("slice4", "slice8", "baremetal")
            }
    return out


def report(title: str, out: dict, reference: float) -> None:
    print(f"{title}; free repacking would serve {reference:.4f} of the bound")
    shapes = [s[0] for s in SHAPES]
    for key in ("free_form", "partitions"):
        print(f"{key:>10} {'policy':>9} {'of bound':>8} " + " ".join(f"{s:>9}" for s in shapes) + "    frag")
        for name, r in out[key].items():
            acc = " ".join(f"{r['acceptance'][s]:>9.4f}" for s in shapes)
            gain = " ".join(f"{k} {v:+.1f}" for k, v in r.get("vs_first_fit_points", {}).items())
            print(f"{'':>10} {name:>9} {r['share_of_bound']:>8.4f} {acc}  {r['fragmentation']:.4f}  {gain}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--hours", type=float, default=400.0)
    ap.add_argument("--load", type=float, default=0.9, help="offered GPU load as a share of capacity")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=1, help="run this many seeds from --seed on and add their mean")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs = [run(args.nodes, args.hours, args.load, seed) for seed in range(args.seed, args.seed + args.seeds)]
    mean = mean_of(runs) if len(runs) > 1 else None
    if args.json:
        print(json.dumps({"runs": runs, "mean": mean} if mean else runs[0], indent=2))
        return
    for r in runs:
        title = f"seed {r['seed']}: {r['requests']} requests, upper bound {r['upper_bound_gpu_hours']} GPU-hours"
        report(title, r, r["repacking_reference"]["share_of_bound"])
    if mean:
        report(f"mean of {len(runs)} seeds", mean, mean["repacking_reference"])


if __name__ == "__main__":
    main()
