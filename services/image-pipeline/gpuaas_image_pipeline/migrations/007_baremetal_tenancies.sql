-- Baremetal tenancies, learnt from the allocator's lifecycle events and the gateway's MAAS release results: a
-- node a baremetal tenant holds (root on the host, its allocation-bound NATS creds) may not enrol as a slice
-- host. One row per baremetal allocation, holding what the pipeline has seen of it; each fact is only ever set,
-- so events handled in any order leave the same row. domain/tenancy.py judges from them whether the tenancy
-- is open, and if not, why (`state`: not_started, or the reason it ended).
CREATE TABLE baremetal_tenancies (
    allocation_id    uuid PRIMARY KEY,
    node_id          text NOT NULL,
    -- When the allocation was placed on the node (its placed event's occurred_at), NULL until that is seen.
    placed_at        timestamptz,
    started          boolean NOT NULL DEFAULT false,  -- placed or provisioning seen
    deploy_sent      boolean NOT NULL DEFAULT false,  -- provisioning seen: the deploy went out to MAAS
    released         boolean NOT NULL DEFAULT false,  -- allocation.released
    failed           boolean NOT NULL DEFAULT false,  -- allocation.failed
    machine_released boolean NOT NULL DEFAULT false,  -- maas.release_result released for this allocation
    superseded_by    uuid,                            -- a later baremetal allocation placed on the node
    open             boolean NOT NULL DEFAULT false,
    state            text NOT NULL DEFAULT 'not_started',
    ended_at         timestamptz,                     -- when an open tenancy was judged over
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX baremetal_tenancies_open_idx ON baremetal_tenancies (node_id) WHERE open;
