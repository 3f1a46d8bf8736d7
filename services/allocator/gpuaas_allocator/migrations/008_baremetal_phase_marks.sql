-- A baremetal walk's moments (placed, MAAS Deployed, enrolled, the host's boot seconds) and where MAAS says the
-- tenant logs in, kept until `active` turns them into timeline phases and access details (issue 23, point 4).
ALTER TABLE allocations ADD COLUMN phase_marks jsonb;
