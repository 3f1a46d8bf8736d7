-- The shared admin HTTP stack (gpuaas_common.admin_http): one row per authenticated mutation request,
-- accepted, replayed or rejected, next to the domain-level admin_audit rows the operations write. An
-- accepted request's row commits with its change and its idempotency record; a rejected one is written
-- after the rollback, so the log also shows what was refused.
ALTER TABLE admin_idempotency
    ADD COLUMN request_id text,
    ADD COLUMN actor      text;

CREATE TABLE admin_requests (
    id              bigserial PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    request_id      text NOT NULL,
    principal       text NOT NULL,
    actor           text NOT NULL,
    method          text NOT NULL,
    path            text NOT NULL,
    body_sha256     text NOT NULL,
    idempotency_key text,
    status          integer NOT NULL,
    replayed        boolean NOT NULL DEFAULT false,
    error_code      text
);
CREATE INDEX admin_requests_at_idx ON admin_requests (at);
CREATE INDEX admin_requests_request_id_idx ON admin_requests (request_id);
