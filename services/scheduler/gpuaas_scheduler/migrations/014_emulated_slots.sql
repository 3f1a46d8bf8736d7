-- Emulated slots: a disk, a MAC and an IP with no GPU and no fabric VF, offered by a lab host under QEMU/TCG
-- (issue: a real slice host in the lab). They stand for a GPU they do not pretend to have: the slot rules let
-- them through without GPU and VF only when `emulated` is set, and approval makes them `available` only where
-- the scheduler's settings allow emulated slots at all.
ALTER TABLE candidate_slots ADD COLUMN emulated boolean NOT NULL DEFAULT false;
ALTER TABLE node_resource_slots ADD COLUMN emulated boolean NOT NULL DEFAULT false;
-- An emulated slot has no GPU: the GPU address is NULL, and the candidate is keyed by its disk instead.
ALTER TABLE candidate_slots ADD CONSTRAINT emulated_has_no_gpu
    CHECK (NOT emulated OR (gpu_pci_address IS NULL AND fabric_vf_pci_address IS NULL));
ALTER TABLE node_resource_slots ADD CONSTRAINT emulated_has_no_gpu
    CHECK (NOT emulated OR (gpu_pci_address IS NULL AND fabric_vf_pci_address IS NULL));
