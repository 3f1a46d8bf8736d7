-- At most one operation per machine whose MAAS call may be in flight (submitting) or whose outcome is
-- not known (unknown). Two pending operations on one machine used to be able to pass the gateway's
-- "is the machine busy?" read together and both submit; now the second conditional update to
-- 'submitting' violates this index and the operation waits, whatever the interleaving of workers.
-- Operations without a machine (tags, images) have a NULL system_id and are not constrained.
CREATE UNIQUE INDEX maas_operations_one_in_doubt_per_machine ON maas_operations (site, system_id)
    WHERE state IN ('submitting', 'unknown');
