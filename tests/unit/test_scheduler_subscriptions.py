"""The scheduler's lifecycle durable delivers exactly the events its handlers act on: no handler waits for an
event its filters leave out, and the server sends it nothing it would only acknowledge."""

from __future__ import annotations

from gpuaas_common.contract import spec_for
from gpuaas_common.jetstream import CONSUMER_BY_NAME, subject_matches
from gpuaas_scheduler.service_layer.handlers import Scheduler, handlers


def test_the_lifecycle_durable_filters_on_the_handled_events_only() -> None:
    spec = CONSUMER_BY_NAME["scheduler-allocation-events"]
    handled = set(handlers(Scheduler()))
    delivered = {
        f"allocation.{name}"
        for name in ("accepted", "placed", "unschedulable", "provisioning", "active", "releasing", "released", "failed")
        if any(subject_matches(f, spec_for(f"allocation.{name}").subject()) for f in spec.filters)
    }
    assert delivered == handled
    assert spec.admin_provisioned
    for type_ in handled:
        assert "scheduler" in spec_for(type_).consumers
    for type_ in ("allocation.placed", "allocation.unschedulable", "allocation.rejected"):
        assert "scheduler" not in spec_for(type_).consumers
