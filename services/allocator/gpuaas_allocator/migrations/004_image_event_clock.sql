-- The time of the newest image.activated / image.deactivated applied per slug. Replicas share the
-- allocator-images durable, so an activation and the deactivation after it can be handled by two
-- replicas at once and commit in either order; an event older than the one applied is stale. Kept
-- after a deactivation deletes the active_images row (a tombstone), so a late activation stays out.
CREATE TABLE image_event_clock (
    slug     text PRIMARY KEY,
    event_at timestamptz NOT NULL
);
