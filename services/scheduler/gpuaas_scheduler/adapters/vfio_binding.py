"""The slots a host's VFIO binding is derived from: every slot of the node with its devices and status."""

from __future__ import annotations

import asyncpg

from ..domain.vfio_binding import SlotDevices


async def slot_devices(conn: asyncpg.Connection, node_id: str) -> list[SlotDevices]:
    rows = await conn.fetch(
        "SELECT slot_id, gpu_pci_address, fabric_vf_pci_address, status FROM node_resource_slots "
        "WHERE node_id = $1 ORDER BY slot_id",
        node_id,
    )
    return [SlotDevices(r["slot_id"], r["gpu_pci_address"], r["fabric_vf_pci_address"], r["status"]) for r in rows]


class VfioSlotRepository:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def slot_devices(self, node_id: str) -> list[SlotDevices]:
        return await slot_devices(self.conn, node_id)
