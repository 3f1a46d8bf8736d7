-- Host drift from the node agent's reconciler (issue 12, deliverable 8). Each `node.drift_reported`
-- carries the full current list, so the latest report is the truth: an item it no longer names is resolved,
-- a new one opens. Open drift on a slot keeps the slot out of placement; open drift with no slot (the agent
-- could not tie it to one, e.g. a libvirt domain nobody knows) keeps the whole node out. Ops acknowledge
-- what they have looked at through the admin API; an acknowledged item stays acknowledged while the agent
-- keeps reporting it, and a newer report without it resolves it.

-- The evidence as it came, one row per report applied (swept orphans included).
CREATE TABLE node_drift_reports (
    event_id    text PRIMARY KEY,
    node_id     text NOT NULL REFERENCES nodes (node_id),
    checked_at  timestamptz NOT NULL,
    drift       jsonb NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX node_drift_reports_node ON node_drift_reports (node_id, checked_at DESC);

CREATE TABLE node_drift (
    drift_id          bigserial PRIMARY KEY,
    node_id           text NOT NULL REFERENCES nodes (node_id),
    -- NULL: the node as a whole.
    slot_id           text REFERENCES node_resource_slots (slot_id),
    kind              text NOT NULL,
    subject           text NOT NULL,
    detail            text NOT NULL,
    devices           jsonb NOT NULL DEFAULT '[]',
    status            text NOT NULL CHECK (status IN ('open', 'acknowledged', 'resolved')),
    first_reported_at timestamptz NOT NULL,
    last_reported_at  timestamptz NOT NULL,
    acknowledged_at   timestamptz,
    acknowledged_by   text,
    ack_reason        text,
    resolved_at       timestamptz,
    resolved_by       text
);
-- One current (not resolved) row per item and place.
CREATE UNIQUE INDEX node_drift_current ON node_drift (node_id, kind, subject, COALESCE(slot_id, ''))
    WHERE status <> 'resolved';
CREATE INDEX node_drift_open_slot ON node_drift (slot_id) WHERE status = 'open';

ALTER TABLE nodes
    -- `checked_at` of the last drift report applied: an older one redelivered late cannot reopen drift.
    ADD COLUMN drift_reported_at timestamptz,
    -- Open node-wide drift (kept with node_drift by the scheduler): slice placement skips the node.
    ADD COLUMN drift_open boolean NOT NULL DEFAULT false;
