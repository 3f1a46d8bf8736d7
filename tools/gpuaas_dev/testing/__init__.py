"""Real servers on loopback, a contract-checking bus spy and deadline waits: for tests, benchmarks and the
dev stack only. No production package imports it (import-linter contract in pyproject.toml)."""
