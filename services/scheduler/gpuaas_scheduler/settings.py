from pydantic import Field, SecretStr

from gpuaas_common.settings import EnvList, ServiceSettings


class SchedulerSettings(ServiceSettings):
    # Fleet description to seed the inventory from (the simulated fleet, or a lab's export).
    inventory_file: str | None = None
    # Hard reserve: a slice may break a clean slice host only while more than this many clean hosts
    # remain in its region/SKU (they are kept whole for baremetal and 8-GPU slices).
    clean_node_watermark: int = Field(default=0, ge=0)
    # GPUs a tenant may hold when the admin API has set no quota of its own; None = unlimited.
    tenant_gpu_quota: int | None = Field(default=None, ge=0)
    # Candidate nodes read per index page while ranking; larger pages cost more on every placement.
    candidate_page: int = Field(default=16, ge=1, le=1000)
    # Emulated slots (a lab host's disks standing for GPUs it does not have, under QEMU/TCG): approval makes them
    # available, and an emulated parity report counts as passing, only when this is set. Never on a GPU fleet.
    allow_emulated_slots: bool = False
    # Admin HTTP API address; 0.0.0.0 in a container so a published port reaches it.
    admin_host: str = "127.0.0.1"
    # 0 picks a free port (written into the ready file).
    admin_port: int = Field(default=0, ge=0, le=65535)
    # Bearer token of the admin API (the `ops-admin` principal: reads and changes); without one the API does not
    # listen.
    admin_token: SecretStr | None = None
    # Bearer token of the ops console (ops-view's `ops-console` principal): it reads, and changes only what the
    # signed-in person it asserts may (`ops-admin` rights), audited under that person. Unset: the console only reads.
    console_token: SecretStr | None = None
    # How often the claim audit runs (service_layer/claim_audit.py: claims of allocations the allocator ended or
    # never heard of, whose news this database lost, are settled with the allocator's word).
    claim_audit_sweep_interval_s: float = Field(default=30.0, gt=0)
    # How long an allocation's claims go unchecked before the allocator is asked about them again.
    claim_audit_every_s: float = Field(default=300.0, gt=0)
    # Claims younger than this are not asked about (their placement answer may still travel), and an end the
    # allocator made less than this ago is left to its event, which carries the wipe proof.
    claim_audit_min_age_s: float = Field(default=60.0, ge=0)
    # Claims of an allocation the allocator has no record of are released (slots to cleanup_blocked) once this
    # old; a portal asking its request again brings the record back well before.
    claim_orphan_after_s: float = Field(default=900.0, gt=0)
    # How long the audit waits for the allocator's answer before it tries again at the next round.
    claim_audit_answer_timeout_s: float = Field(default=5.0, gt=0)
    # Parity of every slice host (slice, drained or converting mode) at least this often: the scheduler asks its
    # agent (slice.parity_check) when neither a report nor an ask is that recent. 0: only after a mode change and
    # on demand (POST /v1/nodes/{node_id}/parity).
    parity_interval_s: float = Field(default=3600.0, ge=0)
    # How often the scheduler looks for hosts owed a parity run (after a mode change, or by parity_interval_s) and
    # closes asks of hosts that did not answer by their deadline.
    steering_sweep_interval_s: float = Field(default=15.0, gt=0)
    # How long a rediscovery or parity task may wait for its host's report before the ask is closed expired.
    node_task_deadline_s: float = Field(default=600.0, gt=0)
    # How long a commissioning asked through the admin API may take before its ask is closed expired.
    commission_deadline_s: float = Field(default=3600.0, gt=0)
    # The gateway's site profile a converting slice host is redeployed with (its `slice_host` profile): the scheduler
    # then walks the host back to slice mode by itself (rediscovery, parity, re-approval of the slots it had), and
    # stops with the reason on the node at the first failure. Unset: converting hosts are onboarded by hand.
    slice_host_profile: str | None = Field(default=None, min_length=1, max_length=128)
    # How often the scheduler starts the walks owed (hosts that entered converting) and stops those ops overtook.
    host_walk_sweep_interval_s: float = Field(default=5.0, gt=0)
    # The MAAS site (gateway) an operator's commissioning (POST /v1/nodes/{node_id}/commission) and a host walk's
    # redeploy are sent to.
    maas_site: str = Field(default="default", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    # The commissioning scripts that run: the slice firmware preflight, which the site has uploaded to MAAS; the
    # gateway judges the run by GPUAAS_MAAS_SLICE_PREFLIGHT_SCRIPT's output.
    commission_scripts: EnvList[str] = Field(default=("50-gpuaas-slice-firmware-preflight",), min_length=1)
