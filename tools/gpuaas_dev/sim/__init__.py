"""The simulated fleet of the dev stack and the tests: generated host trees, simulated DHCP and guests,
instant hosts for benchmarks, simulated baremetal hosts, and `gpuaas-sim-fleet`, which runs them all in
one process. No production package imports it (import-linter contract in pyproject.toml)."""
