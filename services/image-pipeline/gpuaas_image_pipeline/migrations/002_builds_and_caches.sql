-- Builds, the slice hosts the pipeline learnt from enrolments, and richer node cache state.
CREATE TABLE builds (
    build_id        text PRIMARY KEY,
    slug            text NOT NULL REFERENCES os_images (slug) ON DELETE CASCADE,
    status          text NOT NULL CHECK (status IN ('planned', 'queued', 'customising', 'converting', 'packing',
                                                    'pushing', 'published', 'failed')),
    source          text,
    options         jsonb NOT NULL DEFAULT '{}',
    reused_from     text,
    raw_path        text,
    raw_sha256      text,
    virtual_size    bigint,
    data_bytes      bigint,
    artifact_path   text,
    blob_digest     text,
    blob_size       bigint,
    artifact_ref    text,
    manifest_digest text,
    plan            jsonb,
    error           text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX builds_slug_idx ON builds (slug, created_at DESC);

CREATE TABLE slice_hosts (
    node_id          text PRIMARY KEY,
    hostname         text NOT NULL,
    enrolled_at      timestamptz NOT NULL DEFAULT now(),
    last_enrolled_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE os_images ADD COLUMN activation_seq integer NOT NULL DEFAULT 0;

ALTER TABLE node_image_cache DROP CONSTRAINT node_image_cache_status_check;
ALTER TABLE node_image_cache ADD CONSTRAINT node_image_cache_status_check
    CHECK (status IN ('absent', 'pulling', 'verified', 'mismatch', 'failed'));
ALTER TABLE node_image_cache DROP CONSTRAINT node_image_cache_slug_fkey;
ALTER TABLE node_image_cache ADD CONSTRAINT node_image_cache_slug_fkey
    FOREIGN KEY (slug) REFERENCES os_images (slug) ON DELETE CASCADE;
ALTER TABLE node_image_cache
    ADD COLUMN expected_digest text,
    ADD COLUMN task_id         text,
    ADD COLUMN bytes_done      bigint NOT NULL DEFAULT 0,
    ADD COLUMN bytes_total     bigint NOT NULL DEFAULT 0,
    ADD COLUMN reason          text,
    ADD COLUMN updated_at      timestamptz NOT NULL DEFAULT now();
