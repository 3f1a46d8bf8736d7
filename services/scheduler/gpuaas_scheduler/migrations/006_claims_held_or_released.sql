-- A claim is held or released, nothing else: 'in_doubt' was never written (a MAAS outcome that is not known
-- yet keeps the claim held until it is), so a row in that state could only come from a bug.
ALTER TABLE allocation_resource_claims DROP CONSTRAINT allocation_resource_claims_status_check;
ALTER TABLE allocation_resource_claims ADD CONSTRAINT allocation_resource_claims_status_check
    CHECK (status IN ('held', 'released'));
