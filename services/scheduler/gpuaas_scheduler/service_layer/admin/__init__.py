"""Admin operations on the inventory: each runs inside the caller's transaction (the admin stack's unit of
work), takes the node lock before touching slots, writes an audit row, and raises AdminError (rolling
everything back) rather than leaving half of a change behind. Split by topic. Nodes, quotas, drift, site wipe
policies, steering and force-release go through the unit of work's repositories (ports.py; adapters/admin.py),
reads through the one repository they read; the slots' operations still run their statements
(adapters/admin_slots.py) on the connection."""

from .force_release import force_release
from .models import (
    Acted,
    AdminError,
    ApproveIn,
    Body,
    CandidateIn,
    CandidatesIn,
    DrainIn,
    ForceReleaseIn,
    ModeIn,
    NodeIn,
    NvmeEvidence,
    QuotaIn,
    RepairIn,
    RetireIn,
    SiteWipePolicyIn,
    WaiverIn,
)
from .modes import get_mode, set_mode
from .nodes import add_waiver, drain, get_node, list_nodes, undrain, upsert_node
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
from .steer import steer
from .wipe import get_site_wipe_policy, set_site_wipe_policy

__all__ = [
    "Acted",
    "AdminError",
    "ApproveIn",
    "Body",
    "CandidateIn",
    "CandidatesIn",
    "DrainIn",
    "ForceReleaseIn",
    "ModeIn",
    "NodeIn",
    "NvmeEvidence",
    "QuotaIn",
    "RepairIn",
    "RetireIn",
    "SiteWipePolicyIn",
    "WaiverIn",
    "add_waiver",
    "approve",
    "disable",
    "drain",
    "force_release",
    "get_mode",
    "get_node",
    "get_quota",
    "get_site_wipe_policy",
    "get_slot",
    "list_candidates",
    "list_nodes",
    "list_slots",
    "repair",
    "retire_slots",
    "set_mode",
    "set_quota",
    "set_site_wipe_policy",
    "steer",
    "undrain",
    "upsert_candidates",
    "upsert_node",
]
