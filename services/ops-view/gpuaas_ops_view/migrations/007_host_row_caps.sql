-- The host-fed tables are capped per group at insert time (adapters/host_rows.py): each needs an index on its
-- group and order, so a trim walks the cap's worth of one group and deletes an index range, never the table.
-- A phase names the host that reported it (the report's subject: the authenticated part), no longer found
-- through its task: it is counted against that host even once its task is gone. Phases written before name the
-- task's host; those of a task no row holds stay NULL, one group for the sweep.
ALTER TABLE node_task_phases ADD COLUMN node_id text;
UPDATE node_task_phases p SET node_id = t.node_id FROM node_tasks t WHERE t.task_id = p.task_id;
CREATE INDEX node_task_phases_node_idx ON node_task_phases (node_id, at, stream_seq);
-- Also the host page's tasks (adapters/queries.py host_tasks), which filter on the node.
CREATE INDEX node_tasks_node_idx ON node_tasks (node_id, updated_at, task_id);
CREATE INDEX dead_letters_consumer_idx ON dead_letters (consumer, at, dlq_seq);

-- A MAAS release's erase: the mode the allocator asked (maas.release_requested) or the gateway applied, and what
-- MAAS showed of it (maas.release_result: erased, failed, unconfirmed). NULL for other operations and from
-- gateways older than the fields.
ALTER TABLE maas_operations ADD COLUMN erase_mode text;
ALTER TABLE maas_operations ADD COLUMN erase_outcome text;
