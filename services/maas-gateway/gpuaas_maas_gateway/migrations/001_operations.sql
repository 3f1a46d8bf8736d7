CREATE TABLE maas_operations (
    operation_id    text PRIMARY KEY,
    kind            text NOT NULL CHECK (kind IN ('deploy', 'release')),
    allocation_id   uuid NOT NULL,
    site            text NOT NULL,
    system_id       text NOT NULL,
    node_id         text NOT NULL,
    profile         text,
    erase           boolean,
    -- pending: not yet sent; submitting: intent recorded, call in flight (a crash here means unknown);
    -- unknown: the call's outcome is not known and is being observed; accepted: MAAS took it and
    -- works on it; succeeded / failed: final.
    state           text NOT NULL CHECK (state IN ('pending', 'submitting', 'unknown', 'accepted', 'succeeded', 'failed')),
    resolution      text NOT NULL DEFAULT 'direct',
    maas_calls      integer NOT NULL DEFAULT 0,
    unknown_since   timestamptz,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    deadline_at     timestamptz NOT NULL,
    last_status     text,
    status_message  text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX maas_operations_open ON maas_operations (next_attempt_at)
    WHERE state IN ('pending', 'submitting', 'unknown', 'accepted');
