-- Readiness evidence from the bus: the node agent's parity and topology reports, and the image
-- pipeline's per-host cache state.

ALTER TABLE nodes
    -- `checked_at` of the last parity report applied. Kept apart from parity_checked_at, which the
    -- fleet seed and the admin API also write with their own clock: only an older *report* may be
    -- ignored, never a newer report in favour of a seed that happened to run later.
    ADD COLUMN parity_reported_at   timestamptz,
    -- `discovered_at` of the last topology report applied, so a redelivered old report cannot
    -- replace the candidates of a newer one.
    ADD COLUMN topology_reported_at timestamptz,
    ADD COLUMN topology_blockers    jsonb;

-- One row per (host, image slug): the last `image.node_cache_changed` seen. No foreign key on
-- nodes: the image pipeline may know a host before this scheduler does, and a row about a host it
-- does not know is harmless (placement joins it from the node side).
CREATE TABLE node_image_readiness (
    node_id       text NOT NULL,
    slug          text NOT NULL,
    status        text NOT NULL CHECK (status IN ('absent', 'pulling', 'verified', 'mismatch', 'failed')),
    digest_sha256 text,
    schedulable   boolean NOT NULL,
    reported_at   timestamptz NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node_id, slug)
);
-- "Has this image ever been reported?" decides whether the cache gate applies (see image_gate).
CREATE INDEX node_image_readiness_by_slug ON node_image_readiness (slug);
