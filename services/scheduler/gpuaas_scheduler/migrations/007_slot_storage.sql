-- Slot storage metadata, as the slice-node-bootstrap runbook records it at approval
-- (capacity_metadata.storage_ownership=slice; storage_mode=slice; destructive_wipe_policy=blkdiscard;
-- storage_identity_kind=nvme_wwn_by_id):
--   storage_ownership      who owns the raw NVMe: `slice` = infra approved it as a tenant slice disk (no host share);
--   storage_mode           how it is used: `slice` = a raw device handed whole to one VM;
--   destructive_wipe_policy the site's wipe between tenants: `blkdiscard`, `nvme_format` or `crypto_erase`;
--                          a released slot returns to `available` only with a verified proof made by that method;
--   storage_identity_kind  how the disk is named: `nvme_wwn_by_id` = /dev/disk/by-id/nvme-eui.* (kernel names move
--                          across reboots).
ALTER TABLE node_resource_slots
    ADD COLUMN storage_ownership text NOT NULL DEFAULT 'slice' CHECK (storage_ownership IN ('slice')),
    ADD COLUMN storage_mode text NOT NULL DEFAULT 'slice' CHECK (storage_mode IN ('slice')),
    ADD COLUMN destructive_wipe_policy text NOT NULL DEFAULT 'blkdiscard'
        CHECK (destructive_wipe_policy IN ('blkdiscard', 'nvme_format', 'crypto_erase')),
    ADD COLUMN storage_identity_kind text NOT NULL DEFAULT 'nvme_wwn_by_id'
        CHECK (storage_identity_kind IN ('nvme_wwn_by_id'));
