"""The gateway's readings for /metrics (`gpuaas_common.metrics`): MAAS operations by kind and state (the final
states are the outcomes), and for operations whose outcome is unknown, how long it has been and how long is left
before their deadline fails them. Read from its own table when it is scraped; the counters and histograms of calls
and outcomes are service_layer/metrics.py's."""

from __future__ import annotations

from typing import Any

from gpuaas_common.metrics import INFINITY, Family, Reading, Sample, seconds

KINDS = ("deploy", "release", "commission", "sync_tags", "upload_image", "set_distro_series")
STATES = ("pending", "submitting", "unknown", "accepted", "succeeded", "failed")

OPERATIONS = Family(
    "gpuaas_maas_operations",
    "MAAS operations by kind and state (succeeded and failed are outcomes, the rest in flight)",
    ("kind", "state"),
)
UNKNOWN_AGE = Family(
    "gpuaas_maas_unknown_outcome_age_seconds",
    "How long the oldest operation whose outcome is unknown has been so (0 when none is)",
    ("kind",),
)
UNKNOWN_DEADLINE = Family(
    "gpuaas_maas_unknown_outcome_deadline_seconds",
    "Seconds left before the nearest deadline of an operation whose outcome is unknown (+Inf when none is)",
    ("kind",),
)


def operations_reading(pool: Any) -> Reading:
    async def read() -> list[Sample]:
        async with pool.acquire() as conn:
            counts = await conn.fetch("SELECT kind, state, count(*) AS n FROM maas_operations GROUP BY kind, state")
            unknown = await conn.fetch(
                "SELECT kind, max(EXTRACT(EPOCH FROM clock_timestamp() - unknown_since)) AS age, "
                "min(EXTRACT(EPOCH FROM deadline_at - clock_timestamp())) AS left_s "
                "FROM maas_operations WHERE state = 'unknown' GROUP BY kind"
            )
        n = {(r["kind"], r["state"]): r["n"] for r in counts}
        grid = [(kind, state) for kind in KINDS for state in STATES]
        out = [OPERATIONS(kind, state, value=n.get((kind, state), 0)) for kind, state in grid]
        out += [OPERATIONS(kind, state, value=v) for (kind, state), v in n.items() if (kind, state) not in grid]
        found = {r["kind"]: r for r in unknown}
        for kind in sorted({*KINDS, *found}):
            r = found.get(kind)
            out.append(UNKNOWN_AGE(kind, value=seconds(r["age"]) if r else 0.0))
            out.append(UNKNOWN_DEADLINE(kind, value=seconds(r["left_s"]) if r else INFINITY))
        return out

    return read
