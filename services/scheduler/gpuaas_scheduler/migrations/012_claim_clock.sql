-- A claim's lifetime in the order things happened, not in the order transactions began: now() is the start
-- of the transaction, so a placement whose transaction began before another allocation's release committed
-- (and then waited for the slot's lock) was stamped earlier than that release, and the two claims looked as
-- if they had overlapped (the chaos checker reads claim history this way). clock_timestamp() is the moment
-- of the insert, which can only come after the release it waited for.
ALTER TABLE allocation_resource_claims ALTER COLUMN created_at SET DEFAULT clock_timestamp();
