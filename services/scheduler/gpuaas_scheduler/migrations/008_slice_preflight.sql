-- Commissioning preflight evidence (issue 12, deliverable 4): every `node.slice_preflight_reported`
-- the MAAS gateway published, and on the node the latest verdict, which slice placement gates on
-- (NULL: no preflight reported yet = missing).
CREATE TABLE node_slice_preflight (
    operation_id   text PRIMARY KEY,
    node_id        text REFERENCES nodes (node_id),
    site           text NOT NULL,
    system_id      text NOT NULL,
    result_set_id  integer,
    script_name    text NOT NULL,
    script_status  text,
    exit_status    integer,
    status         text NOT NULL CHECK (status IN ('passed', 'failed', 'missing')),
    reasons        jsonb NOT NULL DEFAULT '[]',
    warnings       jsonb NOT NULL DEFAULT '[]',
    checks         jsonb NOT NULL DEFAULT '[]',
    nvme           jsonb NOT NULL DEFAULT '[]',
    reported_at    timestamptz NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX node_slice_preflight_node ON node_slice_preflight (node_id, reported_at DESC);
CREATE INDEX node_slice_preflight_system ON node_slice_preflight (system_id, reported_at DESC);

ALTER TABLE nodes
    ADD COLUMN preflight_status text CHECK (preflight_status IN ('passed', 'failed', 'missing')),
    ADD COLUMN preflight_reported_at timestamptz,
    ADD COLUMN preflight_operation_id text;
