-- A host back from maintenance owes its wipe proof for its slots' disks (issue 38, point 1): a technician may have
-- swapped or touched them. Its undrain asks the wipe (domain/slot_wipe.py MAINTENANCE_RETURN_RULES).
ALTER TABLE slot_wipes DROP CONSTRAINT slot_wipes_cause_check;
ALTER TABLE slot_wipes ADD CONSTRAINT slot_wipes_cause_check CHECK (cause IN ('approval', 'repair', 'maintenance'));

-- An ask past its deadline unanswered is closed `expired` and asked again by the scheduler's sweep.
ALTER TABLE slot_wipes DROP CONSTRAINT slot_wipes_outcome_check;
ALTER TABLE slot_wipes ADD CONSTRAINT slot_wipes_outcome_check
    CHECK (outcome IN ('passed', 'failed', 'superseded', 'expired'));
