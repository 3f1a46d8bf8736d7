"""The gateway's Prometheus metrics, in one place so every operation kind counts the same way."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OP_DURATION = Histogram("gpuaas_maas_operation_seconds", "Command-to-outcome time", ["kind", "outcome"])
UNKNOWN_OUTCOMES = Counter("gpuaas_maas_unknown_outcomes_total", "Mutations whose outcome was unknown", ["kind"])
UNKNOWN_RESOLUTION = Histogram(
    "gpuaas_maas_unknown_resolution_seconds", "Unknown-to-resolved time", ["kind", "decision"]
)
MAAS_CALLS = Counter("gpuaas_maas_mutations_total", "Mutating MAAS calls", ["kind"])
RESUBMITS = Counter("gpuaas_maas_resubmits_total", "Submits repeated after MAAS proved it had not taken one", ["kind"])
BREAKER_STATE = Gauge("gpuaas_maas_breaker_state", "Circuit breaker per site: 0 closed, 1 half-open, 2 open", ["site"])
BREAKER_OPENED = Counter("gpuaas_maas_breaker_opened_total", "Times a site's circuit breaker opened", ["site"])
