-- Replicas of the pipeline share the builds table; a build runs as a task of the replica that started
-- it, which holds its lease and renews it while the build runs. A build whose lease has run out lost its
-- process (killed, or cut off from the database): any replica marks it failed. A starting replica no
-- longer fails every running build, only those.
ALTER TABLE builds ADD COLUMN lease_owner text;
ALTER TABLE builds ADD COLUMN lease_until timestamptz;
