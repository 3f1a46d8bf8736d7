-- The control plane owns the deadline of every node task it sends (issue 12, runbook: "Increased the deployed
-- provisioning node-task TTL to 20m"): the agent enforces it too, but a host that vanishes never answers, so
-- the allocator's deadline sweep fails the allocation once `task_deadline_at` (plus a grace) has passed.
-- `timed_out_task_id` names the task the sweep gave up on, so a late answer for it is recorded, not applied
-- (and not dead-lettered as a task never sent).
ALTER TABLE allocations ADD COLUMN task_deadline_at timestamptz;
ALTER TABLE allocations ADD COLUMN timed_out_task_id text;
CREATE INDEX allocations_awaiting_deadline ON allocations (task_deadline_at) WHERE awaiting_result;
