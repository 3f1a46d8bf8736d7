-- The image's driver strategy travels with the provision task, so the host's guest GPU check knows whether the
-- guest must already have a working driver. Rows from before knew none: the catalog's default is theirs.
ALTER TABLE active_images ADD COLUMN driver_strategy text NOT NULL DEFAULT 'preinstalled'
    CHECK (driver_strategy IN ('preinstalled', 'cloud_init'));
ALTER TABLE allocations ADD COLUMN image_driver_strategy text NOT NULL DEFAULT 'preinstalled';
