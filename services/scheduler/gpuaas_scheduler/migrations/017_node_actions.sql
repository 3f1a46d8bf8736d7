-- Steering a host on demand (issue 26, point 5; domain/steering.py): a rediscovery, a parity run or a
-- commissioning asked of a node, by an operator or by the scheduler itself (periodic parity, parity after a mode
-- change), with its answer once the host's report comes back. `action_id` is the task id (or MAAS operation id)
-- sent, so the report that names it closes the row; the row is the node's history of what was asked and found.
CREATE TABLE node_actions (
    action_id    text PRIMARY KEY,
    node_id      text NOT NULL REFERENCES nodes (node_id),
    kind         text NOT NULL CHECK (kind IN ('rediscover', 'parity', 'commission')),
    actor        text NOT NULL,
    reason       text NOT NULL CHECK (btrim(reason) <> ''),
    status       text NOT NULL DEFAULT 'requested'
                 CHECK (status IN ('requested', 'succeeded', 'failed', 'expired')),
    -- Why it ended as it did, in a sentence (the failing checks, the stale report, the missed deadline).
    outcome      text,
    -- The reports' parts as they came in: {"topology": {...}, "parity": {...}, "preflight": {...}}.
    result       jsonb NOT NULL DEFAULT '{}'::jsonb,
    requested_at timestamptz NOT NULL DEFAULT now(),
    deadline     timestamptz NOT NULL,
    finished_at  timestamptz,
    CHECK ((status = 'requested') = (finished_at IS NULL))
);
-- One open ask of a kind per node: replicas' periodic sweeps and an operator's repeat cannot send it twice.
CREATE UNIQUE INDEX node_actions_one_open ON node_actions (node_id, kind) WHERE status = 'requested';
CREATE INDEX node_actions_by_node ON node_actions (node_id, requested_at DESC);
CREATE INDEX node_actions_open_deadline ON node_actions (deadline) WHERE status = 'requested';
