-- A slot as the scheduler last announced it (scheduler.slots_changed: every slot of a host, its status, reason and
-- health), beside what the placements said of it: a slot never placed is here from its host's first announcement.
-- NULL while no announcement has named the slot. `generation` is the number of the announcement the row took, the
-- host's own count; `announced_at` that event's time.
ALTER TABLE slots ADD COLUMN announced_status text;
ALTER TABLE slots ADD COLUMN status_reason text;
ALTER TABLE slots ADD COLUMN health_state text;
ALTER TABLE slots ADD COLUMN health_detail text;
ALTER TABLE slots ADD COLUMN generation bigint;
ALTER TABLE slots ADD COLUMN announced_at timestamptz;

-- The newest announcement of the host's slots read so far: an older one read after it changes nothing, the same
-- one again is a repeat, another event under the same number is a broken history (dead-lettered).
ALTER TABLE hosts ADD COLUMN slots_generation bigint;
ALTER TABLE hosts ADD COLUMN slots_event_id text;
ALTER TABLE hosts ADD COLUMN slots_changed_at timestamptz;
