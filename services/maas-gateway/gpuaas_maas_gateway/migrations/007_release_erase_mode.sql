-- A release's erase is the command's `erase_mode` (kept in params, as every field without a column of its own);
-- the boolean `erase` it replaced is no longer sent.
ALTER TABLE maas_operations DROP COLUMN erase;
