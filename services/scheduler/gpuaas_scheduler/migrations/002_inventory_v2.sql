-- Inventory v2: profile intent from MAAS tags, readiness evidence, maintenance, a per-node capacity
-- summary for index-ordered ranking, candidate topology kept apart from approved slots, quotas,
-- and the admin API's idempotency and audit records.

ALTER TABLE nodes
    ADD COLUMN maas_tags          text[] NOT NULL DEFAULT '{}',
    ADD COLUMN mode               text NOT NULL DEFAULT 'slice' CHECK (mode IN ('slice', 'baremetal')),
    -- NULL = never reported: a slice host is schedulable only once parity reported failures = 0.
    ADD COLUMN parity_failures    integer CHECK (parity_failures >= 0),
    ADD COLUMN parity_checked_at  timestamptz,
    ADD COLUMN parity_detail      jsonb,
    ADD COLUMN maintenance        boolean NOT NULL DEFAULT false,
    ADD COLUMN maintenance_reason text,
    ADD COLUMN drained_by         text,
    ADD COLUMN drained_at         timestamptz,
    ADD COLUMN gpu_count          integer NOT NULL DEFAULT 8 CHECK (gpu_count > 0),
    -- Capacity summary, rewritten from the slot rows whenever a node's slots change under its lock.
    -- It only orders candidates; every placement re-checks the slot rows themselves.
    ADD COLUMN free_slots         integer NOT NULL DEFAULT 0,
    ADD COLUMN total_slots        integer NOT NULL DEFAULT 0,
    ADD COLUMN sliced             boolean NOT NULL DEFAULT false,
    ADD COLUMN max_switch_free    integer NOT NULL DEFAULT 0,
    ADD COLUMN max_numa_free      integer NOT NULL DEFAULT 0,
    ADD COLUMN numa_free          integer[] NOT NULL DEFAULT '{}',
    ADD COLUMN numa_capacity      integer NOT NULL DEFAULT 0;

UPDATE nodes SET maas_tags = ARRAY['gpuaas-profile-' || profile_intent],
                 mode = CASE WHEN kind = 'baremetal' THEN 'baremetal' ELSE 'slice' END;

ALTER TABLE nodes
    ADD COLUMN accepts_slices    boolean GENERATED ALWAYS AS ('gpuaas-profile-slice-vm' = ANY (maas_tags)) STORED,
    ADD COLUMN accepts_baremetal boolean GENERATED ALWAYS AS ('gpuaas-profile-baremetal' = ANY (maas_tags)) STORED;

-- The slice hot path: equality on region/sku, then the documented rank order (sliced first, best fit, id).
CREATE INDEX nodes_slice_rank ON nodes (region, sku, sliced DESC, free_slots, node_id)
    WHERE accepts_slices AND mode = 'slice' AND parity_failures = 0 AND schedulable AND NOT draining
      AND NOT maintenance AND free_slots > 0;

ALTER TABLE node_resource_slots
    ADD COLUMN ovs_port      text,
    -- Discovery's view of the raw disk: {mounted, mounted_children[], signatures[], is_os_disk}.
    ADD COLUMN nvme_evidence jsonb,
    ADD COLUMN health_detail text,
    ADD COLUMN candidate_id  text,
    ADD COLUMN approved_by   text,
    ADD COLUMN approved_at   timestamptz,
    ADD COLUMN updated_at    timestamptz NOT NULL DEFAULT now(),
    ADD CONSTRAINT slot_health_state CHECK (health_state IN ('unknown', 'healthy', 'degraded', 'failed'));

ALTER TABLE allocation_resource_claims
    ADD COLUMN tenant_id     text,
    ADD COLUMN gpus          integer NOT NULL DEFAULT 1 CHECK (gpus > 0),
    ADD COLUMN fabric_device text,
    ADD COLUMN nvme_by_id    text;
-- Duplicated fabric devices or disks are exclusive shared constraints: never two live claims on one.
CREATE UNIQUE INDEX one_live_claim_per_fabric_device ON allocation_resource_claims (node_id, fabric_device)
    WHERE status <> 'released' AND fabric_device IS NOT NULL AND fabric_device <> '';
CREATE UNIQUE INDEX one_live_claim_per_disk ON allocation_resource_claims (node_id, nvme_by_id)
    WHERE status <> 'released' AND nvme_by_id IS NOT NULL;
CREATE INDEX live_claims_by_tenant ON allocation_resource_claims (tenant_id) WHERE status <> 'released';

CREATE TABLE candidate_slots (
    candidate_id          text PRIMARY KEY,
    node_id               text NOT NULL REFERENCES nodes (node_id),
    gpu_pci_address       text,
    numa_node             integer,
    pcie_switch           text,
    nvme_by_id            text,
    nvme_evidence         jsonb,
    fabric_claim_mode     text,
    fabric_vf_pci_address text,
    mac                   text,
    private_ip            text,
    ovs_bridge            text,
    ovs_port              text,
    profile               text NOT NULL DEFAULT 'h200_1g_24c_64g',
    source                text NOT NULL DEFAULT 'admin',
    approved_slot_id      text,
    updated_at            timestamptz NOT NULL DEFAULT now(),
    UNIQUE (node_id, gpu_pci_address)
);

CREATE TABLE slot_transitions (
    id            bigserial PRIMARY KEY,
    slot_id       text NOT NULL,
    from_status   text,
    to_status     text NOT NULL,
    reason        text,
    actor         text NOT NULL,
    allocation_id uuid,
    detail        jsonb,
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX slot_transitions_by_slot ON slot_transitions (slot_id, id);

CREATE TABLE tenant_quotas (
    tenant_id  text PRIMARY KEY,
    max_gpus   integer NOT NULL CHECK (max_gpus >= 0),
    updated_by text NOT NULL,
    reason     text,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE admin_idempotency (
    key          text PRIMARY KEY,
    method       text NOT NULL,
    path         text NOT NULL,
    request_hash text NOT NULL,
    status_code  integer NOT NULL,
    response     jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE admin_audit (
    id     bigserial PRIMARY KEY,
    actor  text NOT NULL,
    action text NOT NULL,
    target text NOT NULL,
    reason text,
    detail jsonb,
    at     timestamptz NOT NULL DEFAULT now()
);
