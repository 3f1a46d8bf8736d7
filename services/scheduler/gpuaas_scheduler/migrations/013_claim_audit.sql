-- When the claim audit last asked the allocator about a live claim's allocation (service_layer/claim_audit.py).
ALTER TABLE allocation_resource_claims ADD COLUMN audited_at timestamptz;
CREATE INDEX live_claims_by_audit ON allocation_resource_claims (audited_at NULLS FIRST) WHERE status <> 'released';
