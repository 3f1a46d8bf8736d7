CREATE TABLE allocations (
    allocation_id      uuid PRIMARY KEY,
    tenant_id          text NOT NULL,
    shape              text NOT NULL,
    sku                text NOT NULL,
    gpu_count          integer NOT NULL,
    region             text NOT NULL,
    image_slug         text NOT NULL,
    image_digest       text NOT NULL,
    image_path         text NOT NULL,
    request_hash       text NOT NULL,
    request            jsonb NOT NULL,
    state              text NOT NULL,
    node_id            text,
    maas_system_id     text,
    placement          jsonb,
    task_id            text,
    release_task_id    text,
    operation_id       text,
    release_operation_id text,
    deployed           boolean NOT NULL DEFAULT false,
    enrolled           boolean NOT NULL DEFAULT false,
    awaiting_result    boolean NOT NULL DEFAULT false,
    access             jsonb,
    failure_code       text,
    failure_reason     text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX allocations_state ON allocations (state);

CREATE TABLE allocation_timeline (
    allocation_id  uuid NOT NULL REFERENCES allocations (allocation_id),
    seq            integer NOT NULL,
    state          text NOT NULL,
    previous_state text,
    reason_code    text,
    detail         jsonb NOT NULL DEFAULT '{}',
    cause_event_id text,
    at             timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (allocation_id, seq)
);

-- What the image pipeline announced as usable; the allocator never reads the catalog itself.
CREATE TABLE active_images (
    slug          text PRIMARY KEY,
    kind          text NOT NULL,
    sku           text NOT NULL,
    digest_sha256 text NOT NULL,
    image_path    text NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
