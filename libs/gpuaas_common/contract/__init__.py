from .catalog import ALL, BY_TYPE, MessageSpec, spec_for, types_for_subject
from .envelope import Envelope, caused_event_id, derived_event_id, new_event_id, utcnow

__all__ = [
    "ALL",
    "BY_TYPE",
    "Envelope",
    "MessageSpec",
    "caused_event_id",
    "derived_event_id",
    "new_event_id",
    "spec_for",
    "types_for_subject",
    "utcnow",
]
