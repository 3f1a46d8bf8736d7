"""The credential authority: the one process that holds the bus's signing keys and mints, renews and revokes."""
