from .catalog import ALL, BY_TYPE, MessageSpec, spec_for, types_for_subject
from .envelope import Envelope, caused_event_id, derived_event_id, new_event_id, utcnow
from .vocabulary import AllocationState, HostMode, Shape, SlotStatus, TaskType, WipePolicy

__all__ = [
    "ALL",
    "BY_TYPE",
    "AllocationState",
    "Envelope",
    "HostMode",
    "MessageSpec",
    "Shape",
    "SlotStatus",
    "TaskType",
    "WipePolicy",
    "caused_event_id",
    "derived_event_id",
    "new_event_id",
    "spec_for",
    "types_for_subject",
    "utcnow",
]
