-- MAAS lifecycle beyond allocations (commission, tag sync, image upload, profile image switch) runs
-- through the same operations table and worker, so it is recorded, resolved and answered the same way.
ALTER TABLE maas_operations DROP CONSTRAINT maas_operations_kind_check;
ALTER TABLE maas_operations ADD CONSTRAINT maas_operations_kind_check
    CHECK (kind IN ('deploy', 'release', 'commission', 'sync_tags', 'upload_image', 'set_distro_series'));
ALTER TABLE maas_operations ALTER COLUMN allocation_id DROP NOT NULL;
ALTER TABLE maas_operations ALTER COLUMN system_id DROP NOT NULL;
ALTER TABLE maas_operations ALTER COLUMN node_id DROP NOT NULL;
-- params: the command's own fields; progress: what a multi-step operation already did (e.g. the
-- commissioning result id seen before submitting, bytes uploaded); result: what the result event reports.
ALTER TABLE maas_operations ADD COLUMN params jsonb NOT NULL DEFAULT '{}'::jsonb;
ALTER TABLE maas_operations ADD COLUMN progress jsonb NOT NULL DEFAULT '{}'::jsonb;
ALTER TABLE maas_operations ADD COLUMN result jsonb;
ALTER TABLE maas_operations ADD COLUMN resubmits integer NOT NULL DEFAULT 0;
CREATE INDEX maas_operations_machine_open ON maas_operations (site, system_id)
    WHERE state IN ('pending', 'submitting', 'unknown', 'accepted');

-- The image a site profile deploys, when ops switched it away from the configured default.
CREATE TABLE maas_site_profiles (
    site          text NOT NULL,
    profile       text NOT NULL,
    distro_series text NOT NULL,
    operation_id  text NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (site, profile)
);

-- Host images uploaded to a site as custom boot resources.
CREATE TABLE maas_boot_resources (
    site             text NOT NULL,
    name             text NOT NULL,
    architecture     text NOT NULL,
    boot_resource_id integer NOT NULL,
    filetype         text NOT NULL,
    sha256           text NOT NULL,
    size             bigint NOT NULL,
    operation_id     text NOT NULL,
    uploaded_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (site, name, architecture)
);
