-- One placement decision per allocation, whichever consumer delivers `allocation.accepted`: a replay
-- (a new durable starting from the stream's beginning, a republish after the dedup window) must not
-- place an allocation that was already placed or answered unschedulable.
CREATE TABLE placement_decisions (
    allocation_id uuid PRIMARY KEY,
    outcome       text NOT NULL,
    decided_at    timestamptz NOT NULL DEFAULT now()
);
