-- A tenancy now runs from the deploy (the allocator's maas.deploy_requested) to the machine's release through
-- MAAS (domain/tenancy.py): the pipeline no longer follows allocation.placed, provisioning, released or failed.
-- The facts only those events set go; what they decided is carried over first:
-- - a released allocation whose deploy had gone out was released through MAAS (the allocator sends a deployed
--   machine's release to MAAS and reports `released` on its answer): its machine is released;
-- - one placed but never deployed (failed or released before its deploy) never held the node: not deployed;
-- - one placed whose provisioning the pipeline had not seen yet is not deployed until its deploy command is seen
--   (the allocator commits the two together, so it is on the stream already): the only judgement that changes.
UPDATE baremetal_tenancies SET machine_released = true WHERE released AND deploy_sent;

ALTER TABLE baremetal_tenancies DROP COLUMN started, DROP COLUMN released, DROP COLUMN failed;
ALTER TABLE baremetal_tenancies RENAME COLUMN deploy_sent TO deployed;
-- When the deploy went out (the deploy command's occurred_at): orders the deploys to one node (supersession).
-- Rows from before held the placement's time, which the allocator commits with the deploy.
ALTER TABLE baremetal_tenancies RENAME COLUMN placed_at TO deployed_at;

-- The judgement under the new rules (domain/tenancy.py `tenancy_state`), and its stored end.
UPDATE baremetal_tenancies SET
    state = CASE
        WHEN machine_released THEN 'machine_released'
        WHEN superseded_by IS NOT NULL THEN 'superseded'
        WHEN NOT deployed THEN 'not_deployed'
        ELSE 'open'
    END,
    open = deployed AND NOT machine_released AND superseded_by IS NULL,
    ended_at = CASE
        WHEN open AND NOT (deployed AND NOT machine_released AND superseded_by IS NULL) THEN now()
        ELSE ended_at
    END,
    updated_at = now();

COMMENT ON COLUMN baremetal_tenancies.deployed IS 'the allocator''s maas.deploy_requested seen: the deploy went out';
COMMENT ON COLUMN baremetal_tenancies.superseded_by IS 'a later baremetal allocation deployed to the node';
ALTER TABLE baremetal_tenancies ALTER COLUMN state SET DEFAULT 'not_deployed';
