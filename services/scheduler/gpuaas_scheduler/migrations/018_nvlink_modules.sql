-- NVLink partitions (issue 29): each GPU slot's module ID on the HGX board, as discovery mapped it from the GPU's
-- PCI address, and the host's Fabric Manager as discovery found it. NULL module IDs: a slot approved from older
-- evidence or an emulated one; placement keeps the PCIe-switch and NUMA rules for a host without them.
ALTER TABLE candidate_slots ADD COLUMN module_id smallint CHECK (module_id BETWEEN 1 AND 8);
ALTER TABLE node_resource_slots ADD COLUMN module_id smallint CHECK (module_id BETWEEN 1 AND 8);
ALTER TABLE nodes
    ADD COLUMN fabric_manager_mode    text,
    ADD COLUMN fabric_manager_version text,
    ADD COLUMN fabric_manager_active  boolean;
