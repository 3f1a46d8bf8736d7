"""Every durable that reads hosts' subjects declares itself host-fed, so each node's messages have a budget there
(gpuaas_common.bus_budget): a new consumer of NODE_REPORTS that forgot would take a host's flood unbounded."""

from __future__ import annotations

from gpuaas_allocator.entrypoints import main as allocator
from gpuaas_common.jetstream import CONSUMERS
from gpuaas_image_pipeline.entrypoints import main as image_pipeline
from gpuaas_scheduler.entrypoints import main as scheduler


def test_every_durable_on_the_hosts_reports_has_a_budget() -> None:
    host_fed = {c.durable for c in CONSUMERS if c.stream == "NODE_REPORTS"}
    declared = allocator.HOST_FED | scheduler.HOST_FED | image_pipeline.HOST_FED
    assert host_fed == declared
