"""The scheduler's readings for /metrics (`gpuaas_common.metrics`): slots by status, hosts by kind and mode, live
claims, and the age of each host's evidence. Read-only SQL over its own tables, run when it is scraped."""

from __future__ import annotations

from typing import Any

from gpuaas_common.metrics import Family, Reading, Sample, seconds

from ..domain.slots import SLOT_STATUSES

SLOTS = Family("gpuaas_slots", "Approved GPU slots in each status", ("status",))
NODES = Family("gpuaas_nodes", "Hosts of the inventory by kind and host mode", ("kind", "mode"))
CLAIMS = Family("gpuaas_claims_live", "Claims not yet released, by kind (slot or node_exclusive)", ("kind",))
EVIDENCE_AGE = Family(
    "gpuaas_node_evidence_age_seconds",
    "Age of a host's newest evidence of each kind: parity, topology, drift (the reconciler's pass); no sample "
    "for evidence a host never sent",
    ("node_id", "mode", "evidence"),
)
EVIDENCE = ("parity", "topology", "drift")

_EVIDENCE_SQL = (
    "SELECT n.node_id, n.mode, "
    "GREATEST(0, EXTRACT(EPOCH FROM clock_timestamp() - n.parity_reported_at)) AS parity, "
    "GREATEST(0, EXTRACT(EPOCH FROM clock_timestamp() - n.topology_reported_at)) AS topology, "
    "GREATEST(0, EXTRACT(EPOCH FROM clock_timestamp() - "
    "(SELECT max(r.checked_at) FROM node_drift_reports r WHERE r.node_id = n.node_id))) AS drift "
    "FROM nodes n WHERE n.mode <> 'retired' ORDER BY n.node_id"
)


def inventory_reading(pool: Any) -> Reading:
    async def read() -> list[Sample]:
        async with pool.acquire() as conn:
            slots = await conn.fetch("SELECT status, count(*) AS n FROM node_resource_slots GROUP BY status")
            nodes = await conn.fetch("SELECT kind, mode, count(*) AS n FROM nodes GROUP BY kind, mode")
            claims = await conn.fetch(
                "SELECT claim_kind, count(*) AS n FROM allocation_resource_claims WHERE status <> 'released' "
                "GROUP BY claim_kind"
            )
            evidence = await conn.fetch(_EVIDENCE_SQL)
        by_status = {r["status"]: r["n"] for r in slots}
        out = [SLOTS(status, value=by_status.get(status, 0)) for status in (*SLOT_STATUSES, *by_status)]
        out = list({s.values: s for s in out}.values())  # a status the domain does not list yet, once
        out += [NODES(r["kind"], r["mode"], value=r["n"]) for r in nodes]
        live = {r["claim_kind"]: r["n"] for r in claims}
        out += [CLAIMS(kind, value=live.get(kind, 0)) for kind in sorted({"slot", "node_exclusive", *live})]
        for r in evidence:
            out += [
                EVIDENCE_AGE(r["node_id"], r["mode"], kind, value=seconds(r[kind]))
                for kind in EVIDENCE
                if r[kind] is not None
            ]
        return out

    return read
