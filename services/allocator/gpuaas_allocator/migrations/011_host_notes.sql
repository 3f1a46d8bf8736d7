-- Timeline notes written from hosts' announcements, per allocation: capped (domain HOST_NOTES_PER_ALLOCATION),
-- so a tenant's machine announcing itself over and over cannot grow the timeline without end (issue 38, N2).
ALTER TABLE allocations ADD COLUMN host_notes integer NOT NULL DEFAULT 0;
