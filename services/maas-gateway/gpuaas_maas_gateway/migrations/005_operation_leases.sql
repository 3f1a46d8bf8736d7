-- Replicas of the gateway share this table. An operation is stepped only by the worker holding its
-- lease: taken with FOR UPDATE SKIP LOCKED among the due rows whose lease is free or expired, renewed
-- while the step runs, dropped when the step ends. A worker killed mid-step leaves its lease to run
-- out; only then does another take the operation over (a `submitting` one as an unknown outcome).
ALTER TABLE maas_operations ADD COLUMN lease_owner text;
ALTER TABLE maas_operations ADD COLUMN lease_until timestamptz;
