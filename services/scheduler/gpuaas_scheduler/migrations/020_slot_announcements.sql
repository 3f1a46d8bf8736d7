-- Each host's slots are announced on the bus when they change outside placement (scheduler.slots_changed: every
-- slot with its status and health). The announcements of a host are numbered: the counter grows by one in the
-- transaction that announces, under the node's row lock, so a reader keeps the highest it has read.
ALTER TABLE nodes ADD COLUMN slots_announced bigint NOT NULL DEFAULT 0;
