-- A build of a slug the catalog does not know yet no longer creates its catalog row up front: the row appears
-- when the build publishes, so a first build that fails (a base whose checksum does not match, a package the
-- archive lacks) leaves no half-written image behind. The build keeps its slug as the name it was asked for,
-- and its row (status, error) stays for diagnosis whether or not the image ever existed.
ALTER TABLE builds DROP CONSTRAINT IF EXISTS builds_slug_fkey;
