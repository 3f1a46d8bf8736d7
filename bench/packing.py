"""Packing quality on a seeded synthetic trace: the scheduler's scorer against first-fit and random,
with an offline upper bound. Pure Python over the scheduler's pure domain functions (no database).

    .venv/bin/python bench/packing.py --json [--nodes 64] [--hours 400] [--seed 1]

Hosts are convertible (both MAAS profile tags): a clean host can go baremetal, any host can be
sliced. Requests arrive as a Poisson process with exponential lifetimes; a refused request is lost.
Metrics: acceptance per shape, GPU-hours served, and fragmentation (time-averaged share of free GPUs
that sit on partly used hosts, where no baremetal request can use them).
Upper bound: GPU-hours no policy can beat, the fluid bound integral of min(offered GPUs alive, capacity).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import defaultdict

from gpuaas_scheduler.domain.placement import SlotView, choose, rank_nodes, summarize

SLOTS = 8
SHAPES = (("slice1", 1, 0.40), ("slice2", 2, 0.20), ("slice4", 4, 0.15), ("slice8", 8, 0.07), ("baremetal", 8, 0.18))


def topology(node: str) -> list[SlotView]:
    return [SlotView(f"{node}-s{i}", 0 if i < 4 else 1, f"sw{i // 2}", f"vf{i}") for i in range(SLOTS)]


class Cluster:
    def __init__(self, nodes: int) -> None:
        self.nodes = [f"n{i:03d}" for i in range(nodes)]
        self.free = {n: {s.slot_id: s for s in topology(n)} for n in self.nodes}
        self.baremetal: set[str] = set()
        self.live: dict[str, int] = defaultdict(int)

    def clean(self, n: str) -> bool:
        return n not in self.baremetal and len(self.free[n]) == SLOTS

    def candidates(self):
        return [
            summarize(n, self.free[n].values(), SLOTS, self.live[n], 4) for n in self.nodes if n not in self.baremetal
        ]


def place_scored(c: Cluster, shape: str, gpus: int, rng: random.Random):
    if shape == "baremetal":
        return next((n for n in c.nodes if c.clean(n)), None), None
    for cand in rank_nodes(c.candidates(), gpus):
        choice = choose(c.free[cand.node_id].values(), gpus, 4)
        if choice:
            return cand.node_id, choice.slots
    return None, None


def place_first_fit(c: Cluster, shape: str, gpus: int, rng: random.Random):
    # Kubernetes-DRA-like: the first node (by name) with enough free devices, the lowest ids on it.
    if shape == "baremetal":
        return next((n for n in c.nodes if c.clean(n)), None), None
    for n in c.nodes:
        if n not in c.baremetal and len(c.free[n]) >= gpus:
            return n, sorted(c.free[n].values(), key=lambda s: s.slot_id)[:gpus]
    return None, None


def place_random(c: Cluster, shape: str, gpus: int, rng: random.Random):
    if shape == "baremetal":
        clean = [n for n in c.nodes if c.clean(n)]
        return (rng.choice(clean) if clean else None), None
    fits = [n for n in c.nodes if n not in c.baremetal and len(c.free[n]) >= gpus]
    if not fits:
        return None, None
    n = rng.choice(fits)
    return n, rng.sample(sorted(c.free[n].values(), key=lambda s: s.slot_id), gpus)


POLICIES = {"scorer": place_scored, "first_fit": place_first_fit, "random": place_random}


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


def simulate(policy: str, events, nodes: int, seed: int) -> dict:
    rng = random.Random(seed)
    c = Cluster(nodes)
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
                for sid in slot_ids:
                    c.free[node][sid] = next(s for s in topology(node) if s.slot_id == sid)
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
        node, slots = POLICIES[policy](c, shape, gpus, rng)
        if node is None:
            continue
        accepted[shape] += 1
        gpu_hours += gpus * life
        c.live[node] += 1
        if shape == "baremetal":
            c.baremetal.add(node)
            heapq.heappush(departures, (t + life, i, node, []))
        else:
            for s in slots:
                del c.free[node][s.slot_id]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--hours", type=float, default=400.0)
    ap.add_argument("--load", type=float, default=0.9, help="offered GPU load as a share of capacity")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    events = trace(args.seed, args.nodes, args.hours, args.load)
    out = {"nodes": args.nodes, "hours": args.hours, "load": args.load, "seed": args.seed, "requests": len(events)}
    for name in POLICIES:
        out[name] = simulate(name, events, args.nodes, args.seed)
    # GPU-hours of requests that ended inside the horizon can run past it; the bound uses the same accounting.
    out["upper_bound_gpu_hours"] = fluid_upper_bound(events, args.nodes)
    out["baremetal_gain_vs_first_fit_points"] = round(
        100 * (out["scorer"]["acceptance"]["baremetal"] - out["first_fit"]["acceptance"]["baremetal"]), 1
    )
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name in POLICIES:
            r = out[name]
            print(
                f"{name:>10}: accept {r['acceptance_all']:.3f} {r['acceptance']} gpu_h {r['gpu_hours']} "
                f"frag {r['fragmentation']}"
            )
        print(f"upper bound gpu_h {out['upper_bound_gpu_hours']}")


if __name__ == "__main__":
    main()
