-- A node task past its deadline is asked again once before the allocation is failed: the agent answers a task
-- it knows from its own record (the result may have been sent and its commit lost here, e.g. a database
-- crash without synchronous commit), and refuses one it never saw without touching the disk.
ALTER TABLE allocations ADD COLUMN task_reasked_at timestamptz;
