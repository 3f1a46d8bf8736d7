-- NATS users minted for baremetal hosts through their deploy user-data. Only public keys are kept:
-- the seed goes to MAAS in the user-data and nowhere else. A release revokes every key of its
-- allocation at once.
CREATE TABLE maas_host_credentials (
    user_public   text PRIMARY KEY,
    allocation_id text NOT NULL,
    node_id       text NOT NULL,
    issued_at     timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    revoked_at    timestamptz
);
CREATE INDEX maas_host_credentials_live ON maas_host_credentials (allocation_id) WHERE revoked_at IS NULL;
