-- The admin APIs' audit records as they published them (AdminRequestRecorded): one per authenticated mutation,
-- applied, replayed or refused, keyed by the event id so a replay or a rebuild writes the same row.
CREATE TABLE audit_records (
    event_id        text PRIMARY KEY,
    service         text NOT NULL,
    request_id      text NOT NULL,
    principal       text NOT NULL,
    actor           text NOT NULL,
    method          text NOT NULL,
    path            text NOT NULL,
    status          integer NOT NULL,
    error_code      text,
    replayed        boolean NOT NULL,
    idempotency_key text,
    reason          text,
    at              timestamptz NOT NULL
);
CREATE INDEX audit_records_at_idx ON audit_records (at DESC, event_id DESC);
CREATE INDEX audit_records_actor_idx ON audit_records (actor, at DESC);
CREATE INDEX audit_records_request_idx ON audit_records (request_id);
