-- Re-drive instead of ignore (issue 13, item 7). A node-task result can arrive for a task the allocator has no
-- record of: its commits of `placed`/`provisioning` were lost (an immediate Postgres restart without
-- synchronous_commit, a promoted asynchronous replica) after the outbox had already sent the task. The result is
-- kept here, the allocator re-asks the scheduler for its placement, and the result is applied once the
-- allocation has caught up to the task (see service_layer/redrive.py).
CREATE TABLE early_task_results (
    allocation_id  uuid NOT NULL REFERENCES allocations (allocation_id),
    task_id        text NOT NULL,
    node_id        text NOT NULL,
    result         jsonb NOT NULL,
    event_id       text NOT NULL,
    received_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (allocation_id, task_id)
);
-- How often the allocator re-asked the scheduler for a placement it never received.
ALTER TABLE allocations ADD COLUMN placement_asks integer NOT NULL DEFAULT 0;
-- Allocations waiting for a placement answer, by how long nothing has happened to them.
CREATE INDEX allocations_awaiting_placement ON allocations (updated_at)
    WHERE node_id IS NULL AND state IN ('accepted', 'releasing');
