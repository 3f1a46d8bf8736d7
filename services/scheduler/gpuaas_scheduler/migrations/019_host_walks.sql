-- The way back to slice mode for a converting host (issue 26, point 5; domain/host_walk.py): a redeploy through
-- MAAS with the slice-host profile, rediscovery, parity and the re-approval of the slots the host had, or a stop
-- with its reason. One row per walk; its steps are the node's history of it (`gpuaas nodes show`).
CREATE TABLE host_walks (
    walk_id              uuid PRIMARY KEY,
    node_id              text NOT NULL REFERENCES nodes (node_id),
    state                text NOT NULL CHECK (state IN ('redeploy_requested', 'deployed', 'rediscovered',
                                                        'parity_passed', 'reapproved', 'stopped')),
    reason               text NOT NULL,
    profile              text,
    -- The MAAS deploy's operation id: its result names it.
    operation_id         text UNIQUE,
    -- The rediscovery asked of the host's agent (node_actions.action_id): its reports name it.
    rediscover_action_id text,
    -- [{slot_id, gpu_pci_address, profile}]: the slots approved when the host left slice mode.
    slots                jsonb NOT NULL DEFAULT '[]'::jsonb,
    parity_passed_early  boolean NOT NULL DEFAULT false,
    started_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now()
);
-- One open walk per host: two replicas' sweeps cannot start two.
CREATE UNIQUE INDEX host_walks_one_open ON host_walks (node_id)
    WHERE state IN ('redeploy_requested', 'deployed', 'rediscovered', 'parity_passed');
CREATE INDEX host_walks_by_node ON host_walks (node_id, started_at DESC);

CREATE TABLE host_walk_steps (
    id         bigserial PRIMARY KEY,
    walk_id    uuid NOT NULL REFERENCES host_walks (walk_id),
    node_id    text NOT NULL,
    from_state text,
    to_state   text NOT NULL,
    reason     text NOT NULL,
    at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX host_walk_steps_by_node ON host_walk_steps (node_id, id DESC);
