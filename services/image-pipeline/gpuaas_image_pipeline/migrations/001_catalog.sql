CREATE TABLE os_images (
    slug              text PRIMARY KEY,
    kind              text NOT NULL CHECK (kind IN ('slice', 'host')),
    status            text NOT NULL CHECK (status IN ('building', 'published', 'active', 'disabled')),
    driver_strategy   text NOT NULL DEFAULT 'preinstalled' CHECK (driver_strategy IN ('preinstalled', 'cloud_init')),
    compatible_sku    text NOT NULL,
    source_uri        text,
    digest_sha256     text,
    metadata          jsonb NOT NULL DEFAULT '{}',
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE node_image_cache (
    node_id       text NOT NULL,
    slug          text NOT NULL REFERENCES os_images (slug),
    status        text NOT NULL CHECK (status IN ('absent', 'pulling', 'verified', 'mismatch')),
    digest_sha256 text,
    local_path    text,
    verified_at   timestamptz,
    PRIMARY KEY (node_id, slug)
);
