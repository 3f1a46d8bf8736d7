-- 1 GiB hugepage capacity as the node agent reports it in `node.topology_reported` (issue 12, deliverable
-- 3). Slots whose runtime profile opts into hugepages (gpuaas_common.profiles) are placed only on a host
-- whose configured pages, less those its live slot claims hold, cover the request. NULL: never reported
-- (or reset with the rest of the topology evidence), which placement treats as no pages.
ALTER TABLE nodes
    ADD COLUMN hugepages_1g_total integer CHECK (hugepages_1g_total >= 0),
    -- Free when discovered: evidence for ops. Placement counts from the total and its own claims, since the
    -- VMs it placed hold pages whether or not they ran when the host last reported.
    ADD COLUMN hugepages_1g_free  integer CHECK (hugepages_1g_free >= 0);
