-- Usage records (domain/usage.py states the rule): one per allocation that became active, from its `active` to
-- the `released` or `failed` that ended it, each the event's own time cut to the whole second. Written from the
-- allocation's timeline, so a replay or a rebuild writes the same row. stopped_at NULL: still running.
CREATE TABLE usage_records (
    allocation_id   uuid PRIMARY KEY,
    tenant_id       text NOT NULL,
    shape           text NOT NULL,
    sku             text,
    gpu_count       integer,
    region          text,
    node_id         text,
    started_at      timestamptz NOT NULL,
    stopped_at      timestamptz,
    ended           text,
    end_reason_code text,
    start_event_id  text NOT NULL,
    stop_event_id   text,
    CHECK (stopped_at IS NULL OR stopped_at >= started_at),
    CHECK ((stopped_at IS NULL) = (ended IS NULL))
);
CREATE INDEX usage_records_tenant_idx ON usage_records (tenant_id, started_at, allocation_id);
CREATE INDEX usage_records_started_idx ON usage_records (started_at, allocation_id);
