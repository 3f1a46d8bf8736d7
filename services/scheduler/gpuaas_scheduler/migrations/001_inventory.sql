CREATE TABLE nodes (
    node_id         text PRIMARY KEY,
    kind            text NOT NULL CHECK (kind IN ('slice_host', 'baremetal')),
    hostname        text NOT NULL,
    region          text NOT NULL,
    pool            text NOT NULL,
    sku             text NOT NULL,
    maas_system_id  text UNIQUE,
    profile_intent  text NOT NULL CHECK (profile_intent IN ('slice-vm', 'baremetal')),
    schedulable     boolean NOT NULL DEFAULT true,
    draining        boolean NOT NULL DEFAULT false,
    drain_reason    text,
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE node_resource_slots (
    slot_id               text PRIMARY KEY,
    node_id               text NOT NULL REFERENCES nodes (node_id),
    gpu_pci_address       text,
    numa_node             integer,
    pcie_switch           text,
    nvme_by_id            text,
    fabric_claim_mode     text,
    fabric_vf_pci_address text,
    mac                   text,
    private_ip            text,
    ovs_bridge            text,
    profile               text NOT NULL,
    status                text NOT NULL CHECK (status IN ('disabled', 'available', 'reserved', 'provisioning',
                                   'active', 'releasing', 'cleanup', 'cleanup_blocked')),
    status_reason         text,
    health_state          text NOT NULL DEFAULT 'healthy',
    generation            bigint NOT NULL DEFAULT 1,
    UNIQUE (node_id, gpu_pci_address)
);
CREATE INDEX slots_available ON node_resource_slots (node_id) WHERE status = 'available';

CREATE SEQUENCE fencing_epoch_seq;

CREATE TABLE allocation_resource_claims (
    claim_id      bigserial PRIMARY KEY,
    allocation_id uuid NOT NULL,
    node_id       text NOT NULL REFERENCES nodes (node_id),
    slot_id       text REFERENCES node_resource_slots (slot_id),
    claim_kind    text NOT NULL CHECK (claim_kind IN ('slot', 'node_exclusive')),
    status        text NOT NULL CHECK (status IN ('held', 'in_doubt', 'released')),
    fencing_epoch bigint NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    released_at   timestamptz,
    CHECK ((claim_kind = 'slot') = (slot_id IS NOT NULL))
);
-- The invariant itself, in the database: never two live claims on one slot or one whole node.
CREATE UNIQUE INDEX one_live_claim_per_slot ON allocation_resource_claims (slot_id)
    WHERE status <> 'released' AND slot_id IS NOT NULL;
CREATE UNIQUE INDEX one_live_exclusive_claim_per_node ON allocation_resource_claims (node_id)
    WHERE status <> 'released' AND claim_kind = 'node_exclusive';
CREATE INDEX claims_by_allocation ON allocation_resource_claims (allocation_id);
CREATE INDEX live_claims_by_node ON allocation_resource_claims (node_id) WHERE status <> 'released';
