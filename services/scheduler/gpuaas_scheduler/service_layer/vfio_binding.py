"""Asking a host's agent for its VFIO binding (slice.vfio_apply) in the transaction that changed its mode or its
approved slots: the task leaves through the same outbox, so a committed change always has its ask, and a
rolled-back one never does."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from gpuaas_common.contract import derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger
from gpuaas_common.outbox import EventCollector

from ..adapters.vfio_binding import VfioSlotRepository
from ..domain.vfio_binding import SlotDevices, binding_change
from .ports import VfioSlots

log = get_logger(__name__)

# As long as the scheduler's other node tasks (GPUAAS_NODE_TASK_DEADLINE_S' default): a binding rebinds a few
# devices in seconds; one past this is stale, and the agent drops it.
VFIO_TASK_DEADLINE_S = 600.0


async def ask_binding(
    slots: VfioSlots | Any, events: EventCollector, node_id: str, from_mode: str, to_mode: str
) -> str | None:
    """Queue the binding the change calls for; its task id, or None when it calls for none. `slots`: a repository,
    or (the admin layer's callers, until they move to ports) a connection to wrap."""
    if not hasattr(slots, "slot_devices"):
        slots = VfioSlotRepository(slots)
    return await raise_binding(
        events, node_id, to_mode, binding_change(from_mode, to_mode, await slots.slot_devices(node_id))
    )


async def raise_binding(
    events: EventCollector, node_id: str, to_mode: str, change: tuple[str, Sequence[SlotDevices]] | None
) -> str | None:
    """The `slice.vfio_apply` task of a binding `binding_change` called for (None: none); its task id."""
    if change is None:
        return None
    action, slots = change
    task_id = f"vfio-{uuid.uuid4().hex}"
    task = m.SliceVfioApply(
        task_id=task_id,
        node_id=node_id,
        deadline=utcnow() + timedelta(seconds=VFIO_TASK_DEADLINE_S),
        action=action,  # type: ignore[arg-type]  # bind | unbind, from binding_change
        slots=[
            m.VfioSlot(
                slot_id=s.slot_id,
                gpu_pci_address=s.gpu_pci_address,  # type: ignore[arg-type]  # binding_change keeps only slots with one
                fabric_vf_pci_address=s.fabric_vf_pci_address,
            )
            for s in slots
        ],
    )
    await events.add(
        "slice.vfio_apply",
        task,
        aggregate_id=node_id,
        correlation_id=task_id,
        event_id=derived_event_id(task_id, "vfio"),
        node_id=node_id,
    )
    log.info("vfio_binding_asked", node_id=node_id, task_id=task_id, action=action, slots=len(slots), to_mode=to_mode)
    return task_id
