"""Request bodies of the inventory admin API and its refusal type (see gpuaas_common.api_error)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuaas_common.api_error import ApiError
from gpuaas_common.profiles import DEFAULT_PROFILE

Name = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")
Reason = Field(min_length=1, max_length=500)
WipePolicy = Literal["blkdiscard", "nvme_format", "crypto_erase"]


class AdminError(ApiError):
    """An inventory operation's refusal (see gpuaas_common.api_error)."""


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Acted(Body):
    actor: str = Name
    reason: str = Reason


class NodeIn(Body):
    actor: str = Name
    node_id: str = Name
    kind: Literal["slice_host", "baremetal"]
    hostname: str = Field(min_length=1, max_length=253)
    region: str = Field(default="default", min_length=1, max_length=64)
    pool: str = Field(default="default", min_length=1, max_length=64)
    sku: str = Field(min_length=1, max_length=64)
    maas_system_id: str | None = None
    maas_tags: list[str] = Field(default_factory=list, max_length=64)
    mode: Literal["slice", "baremetal"] | None = None
    gpu_count: int = Field(default=8, ge=1, le=64)


class ModeIn(Acted):
    mode: Literal["slice", "baremetal", "converting", "drained", "retired"]


class RetireIn(Acted):
    slot_ids: list[str] | None = Field(default=None, max_length=64)


class WaiverIn(Body):
    """A waiver of one approval gate. Reason and expiry are optional here only so that a request lacking
    them is refused with every reason at once (domain/readiness_gate.py), not with a bare schema error."""

    actor: str = Name
    gate: Literal["parity", "preflight"]
    reason: str | None = Field(default=None, max_length=500)
    expires_at: datetime | None = None


class DrainIn(Acted):
    maintenance: bool = False


class NvmeEvidence(Body):
    mounted: bool
    mounted_children: list[str] = Field(default_factory=list)
    signatures: list[str] | None
    is_os_disk: bool


class CandidateIn(Body):
    candidate_id: str = Name
    gpu_pci_address: str | None = Field(default=None, pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
    numa_node: int | None = Field(default=None, ge=0, le=1024)
    pcie_switch: str | None = Field(default=None, max_length=128)
    # The GPU's module ID on the HGX board (nvidia-smi -q), which NVLink partitions are made of.
    module_id: int | None = Field(default=None, ge=1, le=8)
    nvme_by_id: str | None = Field(default=None, max_length=1024)
    nvme_evidence: NvmeEvidence | None = None
    fabric_claim_mode: Literal["per_slot_vf", "shared"] | None = None
    fabric_vf_pci_address: str | None = Field(default=None, max_length=32)
    mac: str | None = Field(default=None, pattern=r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
    private_ip: str | None = Field(default=None, max_length=45)
    ovs_bridge: str | None = Field(default=None, max_length=64)
    ovs_port: str | None = Field(default=None, max_length=64)
    profile: str = Field(default=DEFAULT_PROFILE, pattern=r"^[a-z0-9_]+$", max_length=64)
    # Emulated candidates come only from discovery on a host configured with emulated slot disks (a lab).
    emulated: Literal[False] = False


class CandidatesIn(Body):
    actor: str = Name
    source: Literal["admin", "discovery"] = "admin"
    candidates: list[CandidateIn] = Field(min_length=1, max_length=64)


class ApproveIn(Body):
    actor: str = Name
    reason: str | None = Field(default=None, max_length=500)
    candidate_ids: list[str] | None = Field(default=None, max_length=64)
    # Storage metadata the approval records on each slot (slice-node-bootstrap runbook): infra approved the
    # disk as a slice-owned raw device (`storage_ownership`/`storage_mode` = slice), named by a stable by-id
    # identity, wiped between tenants by the site's `destructive_wipe_policy`, whose proof alone lets a
    # released slot be reused.
    storage_ownership: Literal["slice"] = "slice"
    storage_mode: Literal["slice"] = "slice"
    # Absent: the site's policy when its region has one, else blkdiscard. A different one than the site's is refused.
    destructive_wipe_policy: WipePolicy | None = None
    storage_identity_kind: Literal["nvme_wwn_by_id"] = "nvme_wwn_by_id"
    # The runtime profile of every slot approved (absent: each candidate's own). A lab's emulated slots take a
    # small shape (TCG carries a vCPU or two); a host pool opts into the tuned, hugepage-backed profile here.
    profile: str | None = Field(default=None, pattern=r"^h200_\d+g_\d+c_\d+g(_plain)?$", max_length=64)


class RepairIn(Acted):
    # Evidence for a disabled slot's repair; a cleanup_blocked slot's disk is proven clean only by its host.
    nvme_evidence: NvmeEvidence | None = None
    # Refused whatever it holds (issue 38): a wipe proof is taken only from the slot's own host over the bus. Kept
    # as a field so that a caller who types one gets the reason, not a schema error.
    wipe_proof: dict[str, Any] | None = None


class SiteWipePolicyIn(Acted):
    destructive_wipe_policy: WipePolicy


class ForceReleaseIn(Acted):
    # Release even though the scheduler's record says a VM may still hold the devices.
    force: bool = False


class QuotaIn(Acted):
    max_gpus: int = Field(ge=0, le=1_000_000)
