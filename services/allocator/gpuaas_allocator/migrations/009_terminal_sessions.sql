-- The slice terminal's audit (issue 26, point 8): who opened a session into which allocation's guest, when it
-- started and ended, why it ended, and the bytes each way. The bytes themselves are never stored.
CREATE TABLE terminal_sessions (
    session_id     uuid PRIMARY KEY,
    allocation_id  uuid NOT NULL REFERENCES allocations (allocation_id),
    tenant_id      text NOT NULL,
    actor          text NOT NULL,
    node_id        text NOT NULL,
    task_id        text NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    ended_at       timestamptz,
    end_reason     text,
    bytes_to_guest bigint NOT NULL DEFAULT 0,
    bytes_from_guest bigint NOT NULL DEFAULT 0
);
CREATE INDEX terminal_sessions_allocation ON terminal_sessions (allocation_id, started_at);
