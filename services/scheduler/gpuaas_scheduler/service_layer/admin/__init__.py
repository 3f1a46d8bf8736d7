"""Admin operations on the inventory: each runs inside the caller's transaction (the admin stack's unit of
work), takes the node lock before touching slots, writes an audit row, and raises AdminError (rolling
everything back) rather than leaving half of a change behind. Split by topic; the statements are in
adapters/admin_nodes.py and adapters/admin_slots.py."""

from .models import (
    Acted,
    AdminError,
    ApproveIn,
    Body,
    CandidateIn,
    CandidatesIn,
    DrainIn,
    ModeIn,
    NodeIn,
    NvmeEvidence,
    QuotaIn,
    ReadinessIn,
    RepairIn,
    RetireIn,
)
from .modes import get_mode, set_mode
from .nodes import drain, get_node, list_nodes, set_readiness, undrain, upsert_node
from .quotas import get_quota, set_quota
from .slots import (
    approve,
    disable,
    get_slot,
    list_candidates,
    list_slots,
    repair,
    retire_slots,
    upsert_candidates,
)

__all__ = [
    "Acted",
    "AdminError",
    "ApproveIn",
    "Body",
    "CandidateIn",
    "CandidatesIn",
    "DrainIn",
    "ModeIn",
    "NodeIn",
    "NvmeEvidence",
    "QuotaIn",
    "ReadinessIn",
    "RepairIn",
    "RetireIn",
    "approve",
    "disable",
    "drain",
    "get_mode",
    "get_node",
    "get_quota",
    "get_slot",
    "list_candidates",
    "list_nodes",
    "list_slots",
    "repair",
    "retire_slots",
    "set_mode",
    "set_quota",
    "set_readiness",
    "undrain",
    "upsert_candidates",
    "upsert_node",
]
