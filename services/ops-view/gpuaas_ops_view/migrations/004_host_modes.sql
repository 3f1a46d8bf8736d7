-- A host's mode as the scheduler announced it (scheduler.host_mode_changed) and its history, from the stream:
-- keyed by the event id, so a replay or a rebuild writes the same rows.
ALTER TABLE hosts ADD COLUMN mode text;
ALTER TABLE hosts ADD COLUMN mode_changed_at timestamptz;

CREATE TABLE host_mode_history (
    event_id   text PRIMARY KEY,
    node_id    text NOT NULL,
    from_mode  text NOT NULL,
    to_mode    text NOT NULL,
    actor      text NOT NULL,
    reason     text NOT NULL,
    at         timestamptz NOT NULL
);
CREATE INDEX host_mode_history_node_idx ON host_mode_history (node_id, at DESC, event_id);
