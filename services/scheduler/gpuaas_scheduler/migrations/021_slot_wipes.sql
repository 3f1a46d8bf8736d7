-- Every disk that changes tenant is proven clean by its own host (issue 38, point 1; domain/slot_wipe.py).
-- A slot whose disk may hold someone else's data is approved `awaiting_wipe` and placed nowhere until its host's
-- agent reports a wipe that passes the site's policy.
ALTER TABLE node_resource_slots DROP CONSTRAINT node_resource_slots_status_check;
ALTER TABLE node_resource_slots ADD CONSTRAINT node_resource_slots_status_check
    CHECK (status IN ('disabled', 'available', 'reserved', 'provisioning', 'active', 'releasing', 'cleanup',
                      'cleanup_blocked', 'awaiting_wipe', 'retired'));

-- The wipes the scheduler asked of hosts (slice.slot_wipe), one row per task and slot, and what the host's own
-- report (node.slot_wipe_reported, on its report subject) made of each. A report is taken only for an open row
-- of its task, node and slot; a newer ask for the slot supersedes the older one, whose late report then frees
-- nothing.
CREATE TABLE slot_wipes (
    task_id      text NOT NULL,
    slot_id      text NOT NULL REFERENCES node_resource_slots (slot_id),
    node_id      text NOT NULL REFERENCES nodes (node_id),
    device       text NOT NULL,
    policy       text NOT NULL,
    -- approval (a re-approval or the converting walk's) or repair.
    cause        text NOT NULL CHECK (cause IN ('approval', 'repair')),
    why          text NOT NULL,
    requested_by text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    closed_at    timestamptz,
    outcome      text CHECK (outcome IN ('passed', 'failed', 'superseded')),
    verdict      text,
    -- The host's outcome as reported: its proof (method, verified, signatures, verification) or its refusal.
    report       jsonb,
    PRIMARY KEY (task_id, slot_id)
);
CREATE UNIQUE INDEX slot_wipes_one_open ON slot_wipes (slot_id) WHERE closed_at IS NULL;
CREATE INDEX slot_wipes_by_slot ON slot_wipes (slot_id, requested_at DESC);
