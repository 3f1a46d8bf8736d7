-- The destructive wipe each site (region) requires between tenants. When a site has a row here, its policy is
-- every slot's policy in that region: the release task tells the agent to use it, and a released slot returns
-- to `available` only with a verified proof made by it. Slots of a site without a row keep the policy recorded
-- at their approval (node_resource_slots.destructive_wipe_policy). Changes are audited in admin_audit.
CREATE TABLE site_wipe_policies (
    region text PRIMARY KEY,
    destructive_wipe_policy text NOT NULL
        CHECK (destructive_wipe_policy IN ('blkdiscard', 'nvme_format', 'crypto_erase')),
    set_by text NOT NULL,
    reason text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
