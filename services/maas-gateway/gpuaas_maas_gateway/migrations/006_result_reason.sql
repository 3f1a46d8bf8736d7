-- The reason code of a finished operation, kept so that its result can be sent again when the command is asked
-- again (the asker lost its commit of the first result).
ALTER TABLE maas_operations ADD COLUMN reason_code text;
