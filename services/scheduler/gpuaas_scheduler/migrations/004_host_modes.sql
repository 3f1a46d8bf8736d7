-- Host mode as a state machine (domain/host_mode.py): five modes, who/why/when of the current one, the
-- history of every change, and `retired` slots (a slot that no longer promises its GPU and disk to
-- slices, which a host must have before it may serve baremetal).

ALTER TABLE nodes DROP CONSTRAINT nodes_mode_check;
ALTER TABLE nodes
    ADD CONSTRAINT nodes_mode_check CHECK (mode IN ('slice', 'baremetal', 'converting', 'drained', 'retired')),
    ADD COLUMN mode_changed_at   timestamptz,
    ADD COLUMN mode_changed_by   text,
    ADD COLUMN mode_reason       text,
    -- When parity and topology evidence were last reset to unknown (entering `converting`). Reports
    -- older than this describe the host before MAAS redeployed it and are refused as stale.
    ADD COLUMN evidence_reset_at timestamptz;

ALTER TABLE node_resource_slots DROP CONSTRAINT node_resource_slots_status_check;
ALTER TABLE node_resource_slots ADD CONSTRAINT node_resource_slots_status_check
    CHECK (status IN ('disabled', 'available', 'reserved', 'provisioning', 'active', 'releasing', 'cleanup',
                      'cleanup_blocked', 'retired'));

CREATE TABLE node_mode_history (
    id            bigserial PRIMARY KEY,
    node_id       text NOT NULL REFERENCES nodes (node_id),
    from_mode     text,
    to_mode       text NOT NULL,
    actor         text NOT NULL,
    reason        text NOT NULL,
    allocation_id uuid,
    detail        jsonb,
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX node_mode_history_by_node ON node_mode_history (node_id, id);

-- Existing rows. Until now baremetal placement ignored the mode, so a slice-mode host could be serving
-- a baremetal tenant: such a host is in baremetal mode, and its idle slots no longer promise anything.
-- A host that can only be baremetal is in baremetal mode whatever the column said.
CREATE TEMP TABLE host_mode_backfill ON COMMIT DROP AS
SELECT n.node_id, n.mode AS old_mode,
       CASE WHEN EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.node_id = n.node_id
                         AND c.claim_kind = 'node_exclusive' AND c.status <> 'released') THEN 'baremetal'
            WHEN n.mode = 'slice' AND NOT n.accepts_slices AND n.accepts_baremetal THEN 'baremetal'
            ELSE n.mode END AS new_mode
FROM nodes n;

WITH old AS (
    SELECT s.slot_id, s.status FROM node_resource_slots s JOIN host_mode_backfill b USING (node_id)
    WHERE b.new_mode = 'baremetal' AND s.status IN ('available', 'disabled')
), retired AS (
    UPDATE node_resource_slots s SET status = 'retired', status_reason = 'host serves a baremetal allocation',
        generation = s.generation + 1, updated_at = now()
    FROM old WHERE s.slot_id = old.slot_id
    RETURNING s.slot_id, old.status AS from_status
)
INSERT INTO slot_transitions (slot_id, from_status, to_status, reason, actor)
SELECT slot_id, from_status, 'retired', 'host serves a baremetal allocation', 'migration-004' FROM retired;

UPDATE nodes n SET mode = b.new_mode, mode_changed_at = now(), mode_changed_by = 'migration-004',
    mode_reason = CASE WHEN b.new_mode = b.old_mode THEN 'mode as recorded before host modes'
                       ELSE 'derived from profile tags and live baremetal claims' END
FROM host_mode_backfill b WHERE n.node_id = b.node_id;

INSERT INTO node_mode_history (node_id, from_mode, to_mode, actor, reason)
SELECT b.node_id, NULLIF(b.old_mode, b.new_mode), b.new_mode, 'migration-004', n.mode_reason
FROM host_mode_backfill b JOIN nodes n USING (node_id);
