-- The guest image's NVIDIA driver version travels with the allocation to placement (issue 29, point 4): a host
-- placing NVLink partitions serves the image only when its Fabric Manager has exactly that version. NULL: the
-- catalog names none (every image from before), no gate.
ALTER TABLE active_images ADD COLUMN driver_version text;
ALTER TABLE allocations ADD COLUMN image_driver_version text;
