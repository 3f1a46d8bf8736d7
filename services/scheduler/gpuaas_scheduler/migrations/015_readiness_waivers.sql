-- Waivers of the slot approval gate (issue 26, point 4; domain/readiness_gate.py): an operator's override of a
-- failing parity or commissioning preflight is a record with who, why and until when, never a write to the
-- evidence itself. Kept after expiry: the audit of what was approved under a waiver.
CREATE TABLE node_waivers (
    waiver_id  bigserial PRIMARY KEY,
    node_id    text NOT NULL REFERENCES nodes (node_id),
    gate       text NOT NULL CHECK (gate IN ('parity', 'preflight')),
    actor      text NOT NULL,
    reason     text NOT NULL CHECK (btrim(reason) <> ''),
    expires_at timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CHECK (expires_at > created_at)
);
CREATE INDEX node_waivers_by_node ON node_waivers (node_id, expires_at DESC);
