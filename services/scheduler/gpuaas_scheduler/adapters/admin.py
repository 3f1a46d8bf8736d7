"""The inventory admin's repositories on `uow.repos` (service_layer/ports.py: AdminNodes, Quotas, DriftLog,
WipePolicies, ForceReleases): each on the unit of work's connection, over the statements of admin_nodes.py,
drift.py, wipe_policy.py and inventory. Rows come back as plain dicts, the admin API's answers being built from
them."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import asyncpg

from ..domain.force_release import ForceRelease, ForceReleaseSaved
from ..domain.host_mode import Host as HostModes
from ..domain.node_claims import HeldClaim, NodeDrained, SlotsMoved
from . import admin_nodes as nodes_sql
from . import drift as drift_sql
from . import host_modes as modes_sql
from . import host_walk as walk_sql
from . import inventory as inv
from . import node_actions as actions_sql
from . import wipe_policy as wipe_sql

Row = dict[str, Any]


def _rows(records: Iterable[Mapping[str, Any]]) -> list[Row]:
    return [dict(r) for r in records]


def _row(record: Mapping[str, Any] | None) -> Row | None:
    return dict(record) if record is not None else None


class AdminNodeRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def lock(self, node_id: str) -> bool:
        return await nodes_sql.lock_node(self.conn, node_id) is not None

    async def lock_mode(self, node_id: str) -> str | None:
        return await nodes_sql.lock_node_mode(self.conn, node_id)

    async def register(self, node: Row) -> None:
        await nodes_sql.upsert_node(self.conn, **node)

    async def record_created(self, node_id: str, actor: str, reason: str) -> None:
        await modes_sql.record_created(self.conn, [node_id], actor, reason)

    async def listing(self, region: str | None, sku: str | None) -> list[Row]:
        return _rows(await nodes_sql.list_nodes(self.conn, region, sku))

    async def view(self, node_id: str) -> Row | None:
        return _row(await nodes_sql.node_view(self.conn, node_id))

    async def live_claims(self, node_id: str) -> list[Row]:
        return _rows(await nodes_sql.live_claims(self.conn, node_id))

    async def mode_history(self, node_id: str) -> list[Row]:
        return _rows(await modes_sql.history(self.conn, node_id))

    async def mode_record(self, node_id: str) -> Row | None:
        return _row(await nodes_sql.mode_record(self.conn, node_id))

    async def modes(self, node_id: str) -> HostModes | None:
        loaded = await modes_sql.load_host(self.conn, node_id)
        return loaded[0] if loaded is not None else None

    async def waivers(self, node_id: str) -> list[Row]:
        return _rows(await nodes_sql.waivers(self.conn, node_id))

    async def add_waiver(self, node_id: str, gate: str, actor: str, reason: str, expires_at: datetime) -> Row:
        return dict(await nodes_sql.insert_waiver(self.conn, node_id, gate, actor, reason, expires_at))

    async def actions(self, node_id: str) -> list[Row]:
        return _rows(await actions_sql.history(self.conn, node_id))

    async def walks(self, node_id: str, limit: int) -> list[Row]:
        return _rows(await walk_sql.history(self.conn, node_id, limit=limit))

    async def now(self) -> datetime:
        return await nodes_sql.now(self.conn)


class QuotaRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def set(self, tenant_id: str, max_gpus: int, *, actor: str, reason: str) -> None:
        await nodes_sql.upsert_quota(self.conn, tenant_id, max_gpus, actor=actor, reason=reason)

    async def get(self, tenant_id: str) -> Row | None:
        return _row(await nodes_sql.quota(self.conn, tenant_id))

    async def gpus_in_use(self, tenant_id: str) -> int:
        return int(await nodes_sql.gpus_in_use(self.conn, tenant_id))


class DriftLogRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def node_flags(self, node_id: str) -> Row | None:
        return _row(await drift_sql.node_flags(self.conn, node_id))

    async def items(self, node_id: str, *, include_resolved: bool) -> list[Row]:
        return _rows(await drift_sql.list_drift(self.conn, node_id, include_resolved))

    async def by_id(self, node_id: str, drift_ids: list[int]) -> list[Row]:
        return _rows(await drift_sql.drift_by_id(self.conn, node_id, drift_ids))

    async def acknowledge(self, node_id: str, drift_ids: list[int] | None, actor: str, reason: str) -> list[Row]:
        changed = _rows(await drift_sql.acknowledge(self.conn, node_id, drift_ids, actor, reason))
        if changed:
            await drift_sql.refresh_node_flag(self.conn, node_id)
            await inv.refresh_nodes(self.conn, [node_id])
        return changed


class WipePolicyRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def site(self, region: str) -> Row | None:
        return _row(await wipe_sql.site_policy(self.conn, region))

    async def lock_region(self, region: str) -> None:
        await wipe_sql.lock_region_nodes(self.conn, region)

    async def set_site(self, region: str, policy: str, *, actor: str, reason: str) -> list[str]:
        return await wipe_sql.set_site_policy(self.conn, region, policy, actor=actor, reason=reason)

    async def claimed(self, slot_ids: list[str]) -> list[str]:
        return await wipe_sql.claimed_slots(self.conn, slot_ids)


class ForceReleaseRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def _held(self, allocation_id: uuid.UUID) -> tuple[HeldClaim, ...]:
        return tuple(HeldClaim(**dict(r)) for r in await inv.allocation_slots(self.conn, allocation_id))

    async def get(self, allocation_id: uuid.UUID) -> ForceRelease | None:
        """Read, lock the nodes (in id order: inventory's protocol), read again: a claim ended or a slot moved
        before the locks were granted is seen as it is now."""
        held = await self._held(allocation_id)
        if not held:
            return None
        await inv.lock_nodes(self.conn, [c.node_id for c in held])
        held = await self._held(allocation_id)
        return ForceRelease(str(allocation_id), held) if held else None

    async def save(self, release: ForceRelease) -> ForceReleaseSaved:
        alloc = uuid.UUID(release.allocation_id)
        moved: list[str] = []
        for ch in release.changes:
            if isinstance(ch, SlotsMoved):
                rows = await inv.move_slots(
                    self.conn,
                    ch.slot_ids,
                    ch.status,
                    ch.reason,
                    actor=ch.actor,
                    only_from=ch.only_from,
                    allocation_id=alloc,
                    detail=ch.detail,
                    health=ch.health,
                )
                moved += [r["slot_id"] for r in rows]
            elif isinstance(ch, NodeDrained):
                await inv.drain_node(self.conn, ch.node_id, ch.reason, actor=ch.actor)
        release.changes.clear()
        ended = len(await inv.release_claims(self.conn, alloc)) if release.released else 0
        await inv.refresh_nodes(self.conn, release.node_ids)
        return ForceReleaseSaved(ended, tuple(moved))
