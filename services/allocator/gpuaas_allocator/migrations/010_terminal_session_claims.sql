-- The slice terminal across replicas (issue 38, point 3): which replica holds a live session's websocket, and when
-- it last renewed that claim. A replica that stops renewing (it died) leaves a stale claim that the next open
-- ends as `replica_gone`, so a crash never locks an allocation's console.
ALTER TABLE terminal_sessions ADD COLUMN replica_id text;
ALTER TABLE terminal_sessions ADD COLUMN seen_at timestamptz NOT NULL DEFAULT now();
-- One live session per allocation, whichever replica opens it. Sessions left open by replicas older than this
-- migration are ended first, the newest of each allocation kept.
UPDATE terminal_sessions SET ended_at = now(), end_reason = 'replica_gone'
WHERE ended_at IS NULL AND session_id NOT IN (
    SELECT DISTINCT ON (allocation_id) session_id FROM terminal_sessions
    WHERE ended_at IS NULL ORDER BY allocation_id, started_at DESC
);
CREATE UNIQUE INDEX terminal_sessions_one_live ON terminal_sessions (allocation_id) WHERE ended_at IS NULL;
CREATE INDEX terminal_sessions_live_tenant ON terminal_sessions (tenant_id) WHERE ended_at IS NULL;
