"""The contract's closed word lists, each written once: every service, the CLI and the ops console read them here.

They are `StrEnum`s so that a member is the very string that travels: it compares equal to it, hashes like it,
and serialises to it (JSON, asyncpg text parameters), so using a member instead of the bare string changes no
byte on the bus or in the database.

The payload models (messages.py) keep their `Literal[...]` types: the rendered contract (contracts/asyncapi.yaml)
is derived from them and an enum type would render differently; tests/contract/test_vocabulary.py asserts each
Literal holds exactly its enum's values, and fails on any other copy of a list (a tuple, set, list, dict or
Literal of two or more of one enum's values written out as strings) anywhere outside this package.
"""

from __future__ import annotations

from enum import StrEnum


class Shape(StrEnum):
    """What a tenant asks for: whole GPUs of a slice host, or a whole host."""

    GPU_SLICE = "gpu_slice"
    BAREMETAL = "baremetal"


class AllocationState(StrEnum):
    """An allocation's stored state (the allocator's state machine). `requested` never leaves the allocator's
    transaction, so no lifecycle event carries it; it is still a state a row may be read in."""

    REQUESTED = "requested"
    ACCEPTED = "accepted"
    PLACED = "placed"
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    RELEASING = "releasing"
    RELEASED = "released"
    UNSCHEDULABLE = "unschedulable"
    FAILED = "failed"


class HostMode(StrEnum):
    """Which shape of capacity a host serves (the scheduler's host-mode machine, domain/host_mode.py)."""

    SLICE = "slice"
    BAREMETAL = "baremetal"
    CONVERTING = "converting"
    DRAINED = "drained"
    RETIRED = "retired"


class SlotStatus(StrEnum):
    """A slice slot's status (the scheduler's slot machine, domain/slots.py)."""

    DISABLED = "disabled"
    AVAILABLE = "available"
    RESERVED = "reserved"
    PROVISIONING = "provisioning"
    ACTIVE = "active"
    RELEASING = "releasing"
    CLEANUP = "cleanup"
    CLEANUP_BLOCKED = "cleanup_blocked"
    # Approved, but its disk may hold someone else's data: placeable only once its host proves the site's wipe.
    AWAITING_WIPE = "awaiting_wipe"
    RETIRED = "retired"


class WipePolicy(StrEnum):
    """A site's destructive wipe between tenants."""

    BLKDISCARD = "blkdiscard"
    NVME_FORMAT = "nvme_format"
    CRYPTO_ERASE = "crypto_erase"


class TaskType(StrEnum):
    """Every node task type: each travels on its own subject (catalog.NODE_TASK_PREFIX + the type)."""

    SLICE_VM_PROVISION = "slice.vm_provision"
    SLICE_VM_RELEASE = "slice.vm_release"
    SLICE_TOPOLOGY_DISCOVER = "slice.topology_discover"
    SLICE_PARITY_CHECK = "slice.parity_check"
    SLICE_VFIO_APPLY = "slice.vfio_apply"
    SLICE_SLOT_WIPE = "slice.slot_wipe"
    SLICE_TERMINAL_OPEN = "slice.terminal_open"
    IMAGE_CACHE_PREWARM = "image.cache_prewarm"


# Every vocabulary, by name: what the vocabulary test checks copies of.
VOCABULARIES: tuple[type[StrEnum], ...] = (Shape, AllocationState, HostMode, SlotStatus, WipePolicy, TaskType)
