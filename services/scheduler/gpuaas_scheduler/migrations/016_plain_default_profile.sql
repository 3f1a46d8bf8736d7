-- The default runtime profile is the plain one (gpuaas_common.profiles.DEFAULT_PROFILE, issue 26 point 2): the
-- runbook's 1 GiB hugepages are opt-in, per host pool, through the profile its slots are approved with. A
-- discovered candidate never chose a profile (it took this column's old default, the tuned one): it becomes
-- plain. Approved slots keep the profile an operator approved them with.
ALTER TABLE candidate_slots ALTER COLUMN profile SET DEFAULT 'h200_1g_24c_64g_plain';
UPDATE candidate_slots SET profile = 'h200_1g_24c_64g_plain'
WHERE source = 'node-agent' AND approved_slot_id IS NULL AND profile = 'h200_1g_24c_64g';
