-- What this pipeline asked the MAAS gateway to do for a host image (upload it as a boot resource, switch a
-- site profile's distro_series), keyed by the gateway's operation id: a result is matched to its image by
-- that id, and a result for an operation someone else started is recognised as not ours.
CREATE TABLE maas_requests (
    operation_id text PRIMARY KEY,
    slug         text NOT NULL REFERENCES os_images (slug) ON DELETE CASCADE,
    kind         text NOT NULL CHECK (kind IN ('upload_image', 'set_distro_series')),
    site         text NOT NULL,
    profile      text,
    params       jsonb NOT NULL DEFAULT '{}',
    status       text NOT NULL DEFAULT 'requested' CHECK (status IN ('requested', 'succeeded', 'failed')),
    result       jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX maas_requests_slug_idx ON maas_requests (slug, created_at DESC);
