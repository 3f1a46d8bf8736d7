-- Read models built from the streams (gpuaas_ops_view): nothing here is the truth of any aggregate, every row is
-- what the bus said, and all of it can be rebuilt by replaying the streams into an empty schema. Times are the
-- events' own `occurred_at`, never now(), so a rebuild writes the same rows as the live follower did.

-- Where each followed stream was read up to, committed with the rows it produced: a restart resumes here.
CREATE TABLE stream_positions (
    stream   text PRIMARY KEY,
    last_seq bigint NOT NULL,
    at       timestamptz NOT NULL
);

CREATE TABLE allocations (
    allocation_id   uuid PRIMARY KEY,
    tenant_id       text NOT NULL,
    shape           text NOT NULL,
    state           text NOT NULL,
    seq             integer NOT NULL,
    sku             text,
    gpu_count       integer,
    region          text,
    image           text,
    node_id         text,
    claim_mode      text,
    reason_code     text,
    reason          text,
    access          jsonb,
    why_not         jsonb,
    created_at      timestamptz NOT NULL,
    updated_at      timestamptz NOT NULL
);
CREATE INDEX allocations_tenant_idx ON allocations (tenant_id, created_at DESC);
CREATE INDEX allocations_state_idx ON allocations (state, created_at DESC);
CREATE INDEX allocations_node_idx ON allocations (node_id, created_at DESC);
CREATE INDEX allocations_created_idx ON allocations (created_at DESC, allocation_id);

CREATE TABLE allocation_timeline (
    allocation_id  uuid NOT NULL,
    seq            integer NOT NULL,
    state          text NOT NULL,
    previous_state text,
    event_id       text NOT NULL,
    at             timestamptz NOT NULL,
    detail         jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (allocation_id, seq)
);

-- One per slot (or one per node for node_exclusive) an allocation was placed on.
CREATE TABLE claims (
    allocation_id uuid NOT NULL,
    node_id       text NOT NULL,
    slot_id       text NOT NULL DEFAULT '',
    claim_mode    text NOT NULL,
    placed_at     timestamptz NOT NULL,
    released_at   timestamptz,
    -- wiped: the release carried verified cleanup; cleanup_blocked: a failure or a forced release left the slot
    -- for ops; released: nothing on it was touched.
    outcome       text,
    forced_by     text,
    PRIMARY KEY (allocation_id, node_id, slot_id)
);
CREATE INDEX claims_node_idx ON claims (node_id, slot_id);

CREATE TABLE node_tasks (
    task_id       text PRIMARY KEY,
    allocation_id uuid,
    node_id       text NOT NULL,
    task_type     text,
    sent_at       timestamptz,
    deadline      timestamptz,
    status        text NOT NULL,
    reason_code   text,
    reason        text,
    finished_at   timestamptz,
    updated_at    timestamptz NOT NULL
);
CREATE INDEX node_tasks_allocation_idx ON node_tasks (allocation_id);

CREATE TABLE node_task_phases (
    task_id    text NOT NULL,
    stream_seq bigint NOT NULL,
    phase      text NOT NULL,
    detail     text,
    at         timestamptz NOT NULL,
    PRIMARY KEY (task_id, stream_seq)
);

CREATE TABLE hosts (
    node_id              text PRIMARY KEY,
    kind                 text,
    hostname             text,
    agent_version        text,
    maas_system_id       text,
    enrolled_at          timestamptz,
    parity_profile       text,
    parity_failures      integer,
    parity_warnings      integer,
    parity_failing       jsonb,
    parity_checked_at    timestamptz,
    topology_gpus        integer,
    topology_candidates  integer,
    topology_blockers    jsonb,
    topology_at          timestamptz,
    drift                jsonb,
    drift_checked_at     timestamptz,
    updated_at           timestamptz NOT NULL
);

CREATE TABLE slots (
    node_id     text NOT NULL,
    slot_id     text NOT NULL,
    profile     text,
    gpu_pci     text,
    nvme_by_id  text,
    private_ip  text,
    first_seen  timestamptz NOT NULL,
    PRIMARY KEY (node_id, slot_id)
);

CREATE TABLE images (
    slug          text PRIMARY KEY,
    status        text NOT NULL,
    kind          text,
    sku           text,
    digest_sha256 text,
    build_id      text,
    reason        text,
    updated_at    timestamptz NOT NULL
);

CREATE TABLE image_caches (
    slug          text NOT NULL,
    node_id       text NOT NULL,
    status        text NOT NULL,
    digest_sha256 text,
    schedulable   boolean,
    bytes_done    bigint,
    bytes_total   bigint,
    updated_at    timestamptz NOT NULL,
    PRIMARY KEY (slug, node_id)
);

CREATE TABLE maas_operations (
    operation_id   text PRIMARY KEY,
    op             text NOT NULL,
    allocation_id  uuid,
    node_id        text,
    system_id      text,
    status         text NOT NULL,
    resolution     text,
    reason_code    text,
    status_message text,
    attempts       integer,
    requested_at   timestamptz,
    resolved_at    timestamptz,
    updated_at     timestamptz NOT NULL
);
CREATE INDEX maas_operations_status_idx ON maas_operations (status, updated_at DESC);

CREATE TABLE dead_letters (
    dlq_seq       bigint PRIMARY KEY,
    subject       text NOT NULL,
    consumer      text NOT NULL,
    stream        text NOT NULL,
    origin_subject text NOT NULL,
    origin_seq    bigint,
    reason_code   text NOT NULL,
    reason        text NOT NULL,
    num_delivered integer,
    body_text     text,
    at            timestamptz NOT NULL
);
CREATE INDEX dead_letters_at_idx ON dead_letters (at DESC);

-- placement.force_released, kept apart from the claims it names: it travels on another stream than the
-- placement, so either may be read first.
CREATE TABLE forced_releases (
    allocation_id uuid PRIMARY KEY,
    actor         text NOT NULL,
    reason        text NOT NULL,
    node_ids      jsonb NOT NULL,
    slot_ids      jsonb NOT NULL,
    at            timestamptz NOT NULL
);
