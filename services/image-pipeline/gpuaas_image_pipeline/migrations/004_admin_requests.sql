-- The shared admin HTTP stack (gpuaas_common.admin_http): the stored answer of every mutation by its
-- Idempotency-Key, and one row per authenticated mutation request (accepted, replayed or rejected).
-- Same shape as the scheduler's tables of the same names.
CREATE TABLE admin_idempotency (
    key          text PRIMARY KEY,
    method       text NOT NULL,
    path         text NOT NULL,
    request_hash text NOT NULL,
    status_code  integer NOT NULL,
    response     jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    request_id   text,
    actor        text
);

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
