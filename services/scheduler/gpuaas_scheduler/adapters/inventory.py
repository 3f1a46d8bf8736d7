"""Inventory and claims in Postgres: seeding, candidate queries, SKIP LOCKED claims, release."""

from __future__ import annotations

import uuid
from collections import Counter

import asyncpg

from gpuaas_common.fleet import Fleet

from ..domain.placement import COMPLETE_SLOT_SQL, NodeCandidate, SlotView, incomplete_reason

SLOT_COLUMNS = (
    "slot_id, gpu_pci_address, nvme_by_id, fabric_vf_pci_address, mac, private_ip, ovs_bridge, numa_node, profile"
)


async def seed_from_fleet(conn: asyncpg.Connection, fleet: Fleet) -> int:
    """Insert nodes and slots that are not there yet; never touches the status of existing slots."""
    added = 0
    for node in fleet.nodes:
        intent = "slice-vm" if node.kind == "slice_host" else "baremetal"
        await conn.execute(
            "INSERT INTO nodes (node_id, kind, hostname, region, pool, sku, maas_system_id, profile_intent) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (node_id) DO NOTHING",
            node.node_id, node.kind, node.hostname, node.region, node.pool, node.sku, node.maas_system_id, intent,
        )
        for slot in node.slots:
            data = slot.model_dump()
            reason = incomplete_reason(data)
            inserted = await conn.fetchval(
                "INSERT INTO node_resource_slots (slot_id, node_id, gpu_pci_address, numa_node, pcie_switch, "
                "nvme_by_id, fabric_claim_mode, fabric_vf_pci_address, mac, private_ip, ovs_bridge, profile, "
                "status, status_reason) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14) "
                "ON CONFLICT (slot_id) DO NOTHING RETURNING 1",
                slot.slot_id, node.node_id, slot.gpu_pci_address, slot.numa_node, slot.pcie_switch,
                slot.nvme_by_id, slot.fabric_claim_mode, slot.fabric_vf_pci_address, slot.mac, slot.private_ip,
                slot.ovs_bridge, slot.profile, "disabled" if reason else "available", reason,
            )
            added += inserted or 0
    return added


async def slice_candidates(conn: asyncpg.Connection, region: str, sku: str) -> list[NodeCandidate]:
    rows = await conn.fetch(
        f"""
        SELECT n.node_id,
               count(*) FILTER (WHERE s.status = 'available' AND {COMPLETE_SLOT_SQL}) AS free_slots,
               count(*) AS total_slots,
               (SELECT count(*) FROM allocation_resource_claims c
                 WHERE c.node_id = n.node_id AND c.status <> 'released') AS live_claims
          FROM nodes n JOIN node_resource_slots s ON s.node_id = n.node_id
         WHERE n.kind = 'slice_host' AND n.region = $1 AND n.sku = $2 AND n.schedulable AND NOT n.draining
         GROUP BY n.node_id
        """,
        region, sku,
    )
    return [NodeCandidate(r["node_id"], r["free_slots"], r["total_slots"], r["live_claims"]) for r in rows]


async def filter_counts(conn: asyncpg.Connection, region: str, sku: str, kind: str, requested: int) -> tuple[Counter[str], int]:
    rows = await conn.fetch(
        f"""
        SELECT n.node_id, n.region, n.sku, n.schedulable, n.draining,
               count(s.slot_id) FILTER (WHERE s.status = 'available' AND {COMPLETE_SLOT_SQL}) AS free_slots,
               (SELECT count(*) FROM allocation_resource_claims c
                 WHERE c.node_id = n.node_id AND c.status <> 'released') AS live_claims
          FROM nodes n LEFT JOIN node_resource_slots s ON s.node_id = n.node_id
         WHERE n.kind = $1
         GROUP BY n.node_id
        """,
        kind,
    )
    counts: Counter[str] = Counter()
    free = 0
    for r in rows:
        if r["region"] != region:
            counts["region"] += 1
        elif r["sku"] != sku:
            counts["sku"] += 1
        elif r["draining"]:
            counts["draining"] += 1
        elif not r["schedulable"]:
            counts["not_ready"] += 1
        elif kind == "baremetal":
            if r["live_claims"]:
                counts["claimed"] += 1
            else:
                free += 8
        else:
            free += r["free_slots"]
            if r["free_slots"] < requested:
                counts["free_slot_count"] += 1
    return counts, free


async def claim_slots(
    conn: asyncpg.Connection, node_id: str, allocation_id: uuid.UUID, count: int, choose
) -> tuple[int, list[asyncpg.Record]] | None:
    """Lock free slots of one node with SKIP LOCKED; None when another worker took them first."""
    # FOR SHARE on the node row conflicts only with a baremetal claim, which takes FOR UPDATE.
    node = await conn.fetchrow(
        "SELECT node_id FROM nodes WHERE node_id = $1 AND schedulable AND NOT draining FOR SHARE", node_id
    )
    if node is None:
        return None
    exclusive = await conn.fetchval(
        "SELECT 1 FROM allocation_resource_claims WHERE node_id = $1 AND claim_kind = 'node_exclusive' "
        "AND status <> 'released'", node_id,
    )
    if exclusive:
        return None
    rows = await conn.fetch(
        f"SELECT s.slot_id, s.numa_node, s.pcie_switch FROM node_resource_slots s "
        f"WHERE s.node_id = $1 AND s.status = 'available' AND {COMPLETE_SLOT_SQL} "
        "ORDER BY s.slot_id FOR UPDATE SKIP LOCKED",
        node_id,
    )
    chosen = choose([SlotView(r["slot_id"], r["numa_node"], r["pcie_switch"]) for r in rows], count)
    if not chosen:
        return None
    ids = [s.slot_id for s in chosen]
    epoch = await conn.fetchval("SELECT nextval('fencing_epoch_seq')")
    await conn.executemany(
        "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, fencing_epoch) "
        "VALUES ($1, $2, $3, 'slot', 'held', $4)",
        [(allocation_id, node_id, sid, epoch) for sid in ids],
    )
    await conn.execute(
        "UPDATE node_resource_slots SET status = 'reserved', status_reason = NULL, generation = generation + 1 "
        "WHERE slot_id = ANY($1::text[])", ids,
    )
    bound = await conn.fetch(
        f"SELECT {SLOT_COLUMNS} FROM node_resource_slots WHERE slot_id = ANY($1::text[]) ORDER BY slot_id", ids
    )
    return epoch, bound


async def claim_baremetal(conn: asyncpg.Connection, region: str, sku: str, allocation_id: uuid.UUID) -> asyncpg.Record | None:
    node = await conn.fetchrow(
        """
        SELECT n.node_id, n.maas_system_id FROM nodes n
         WHERE n.kind = 'baremetal' AND n.profile_intent = 'baremetal' AND n.region = $1 AND n.sku = $2
           AND n.schedulable AND NOT n.draining
           AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c
                            WHERE c.node_id = n.node_id AND c.status <> 'released')
         ORDER BY n.node_id
         LIMIT 1
         FOR UPDATE SKIP LOCKED
        """,
        region, sku,
    )
    if node is None:
        return None
    epoch = await conn.fetchval("SELECT nextval('fencing_epoch_seq')")
    await conn.execute(
        "INSERT INTO allocation_resource_claims (allocation_id, node_id, claim_kind, status, fencing_epoch) "
        "VALUES ($1, $2, 'node_exclusive', 'held', $3)",
        allocation_id, node["node_id"], epoch,
    )
    return await conn.fetchrow("SELECT $1::text AS node_id, $2::text AS maas_system_id, $3::bigint AS epoch",
                               node["node_id"], node["maas_system_id"], epoch)


async def set_slot_status(conn: asyncpg.Connection, allocation_id: uuid.UUID, status: str, reason: str | None = None,
                          only_from: tuple[str, ...] | None = None) -> int:
    """Move the slots held by an allocation's live claims."""
    query = (
        "UPDATE node_resource_slots s SET status = $2, status_reason = $3, generation = generation + 1 "
        "FROM allocation_resource_claims c WHERE c.slot_id = s.slot_id AND c.allocation_id = $1 "
        "AND c.status <> 'released'"
    )
    args: list[object] = [allocation_id, status, reason]
    if only_from:
        query += " AND s.status = ANY($4::text[])"
        args.append(list(only_from))
    result = await conn.execute(query, *args)
    return int(result.split()[-1])


async def release_claims(conn: asyncpg.Connection, allocation_id: uuid.UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "UPDATE allocation_resource_claims SET status = 'released', released_at = now() "
        "WHERE allocation_id = $1 AND status <> 'released' RETURNING node_id, slot_id, claim_kind",
        allocation_id,
    )
