"""Host drift from the node agent's reconciler, as placement sees it. Pure.

A report is the agent's full current list, so it replaces what the scheduler held for the node: items it no
longer names are resolved, new ones open, the rest stay as they are (an item ops acknowledged stays
acknowledged while the agent keeps reporting it). Each item lands on the slots it concerns, named by id or by
one of their devices (GPU, fabric VF, disk, MAC, private IP); an item tied to none of the node's slots lands on
the node itself. Swept items are evidence only: the agent already removed the orphan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# The slot columns a drift item's devices are matched against.
SLOT_DEVICE_FIELDS = ("gpu_pci_address", "fabric_vf_pci_address", "nvme_by_id", "mac", "private_ip")

# (kind, subject, slot_id or None for the node)
DriftKey = tuple[str, str, str | None]


@dataclass(frozen=True)
class Item:
    kind: str
    subject: str
    detail: str
    devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Change:
    open: dict[DriftKey, Item]
    still: dict[DriftKey, Item]
    resolve: tuple[DriftKey, ...]


def places(
    slot_ids: Iterable[str], devices: Iterable[str], slots: Sequence[Mapping[str, str | None]]
) -> list[str | None]:
    """The node's slots an item concerns (sorted), or [None]: the whole node."""
    named = set(slot_ids)
    wanted = {d for d in devices if d}
    found = sorted(
        str(s["slot_id"])
        for s in slots
        if s["slot_id"] in named or any(s.get(f) and s.get(f) in wanted for f in SLOT_DEVICE_FIELDS)
    )
    return list(found) if found else [None]


def current_items(
    reported: Iterable[tuple[str, str, str, bool, Sequence[str], Sequence[str]]],
    slots: Sequence[Mapping[str, str | None]],
) -> dict[DriftKey, Item]:
    """What a report says stands now, by key: (kind, subject, detail, swept, slot_ids, devices) per item."""
    out: dict[DriftKey, Item] = {}
    for kind, subject, detail, swept, slot_ids, devices in reported:
        if swept:
            continue
        for slot in places(slot_ids, devices, slots):
            out[(kind, subject, slot)] = Item(kind, subject, detail, tuple(devices))
    return out


def reconcile(held: Iterable[DriftKey], reported: Mapping[DriftKey, Item]) -> Change:
    """How the scheduler's unresolved drift of a node follows a newer report."""
    have = set(held)
    return Change(
        open={k: v for k, v in reported.items() if k not in have},
        still={k: v for k, v in reported.items() if k in have},
        resolve=tuple(sorted(have - set(reported), key=lambda k: (k[0], k[1], k[2] or ""))),
    )
