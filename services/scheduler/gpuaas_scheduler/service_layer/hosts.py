"""What a saved `Host` (domain/host.py) tells the rest of the system, raised in the unit of work that saved it:
the wipe its slots owe (`slice.slot_wipe`), its slots announced once they moved (`scheduler.slots_changed`), the
VFIO binding a mode change asks and the change itself (`scheduler.host_mode_changed`). Every command on a host
reads: load, one method, save, `publish` what was saved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuaas_common.contract import messages as m

from ..domain.host import Change, ModeChanged, WipeAsked
from ..domain.node_claims import SlotsMoved
from .host_modes import announce as announce_mode
from .ports import HostUnitOfWork
from .slot_announcements import announce as announce_slots
from .slot_wipe import raise_task
from .vfio_binding import raise_binding


@dataclass(frozen=True)
class Published:
    vfio_task: str | None = None


async def publish(
    uow: HostUnitOfWork, node_id: str, saved: Sequence[Change], *, slots_cause: m.SlotsChangeCause | None = None
) -> Published:
    """Raise the events of what `uow.repos.hosts.save` wrote, in its order; the host's slots are announced once,
    after their moves, with `slots_cause`."""
    vfio_task = None
    moved_by: str | None = None
    for ch in saved:
        if isinstance(ch, WipeAsked):
            await raise_task(uow.events, ch.task_id, ch.node_id, ch.slots, ch.cause)
        elif isinstance(ch, SlotsMoved):
            moved_by = ch.actor
        elif isinstance(ch, ModeChanged):
            vfio_task = await raise_binding(uow.events, ch.change.node_id, ch.change.to_mode, ch.binding)
            await announce_mode(uow.events, ch.change)
    if moved_by is not None:
        assert slots_cause is not None, "a host whose slots moved is announced with the cause"
        await announce_slots(uow.events, await uow.repos.slots.announcement(node_id, slots_cause, moved_by))
    return Published(vfio_task)
