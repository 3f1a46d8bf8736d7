"""When a node is under a baremetal tenancy (image pipeline, domain/tenancy.py): every order in which the
pipeline may see an allocation's events leads to the same judgement."""

from __future__ import annotations

import itertools

import pytest

from gpuaas_image_pipeline.domain.tenancy import TenancyFacts, facts_of, refusal_reason, tenancy_state

# What each event the pipeline follows adds to an allocation's facts.
EVENTS = {
    "deploy": {"deployed": True},
    "machine_released": {"machine_released": True},
    "superseded": {"superseded": True},
}


def _after(events: tuple[str, ...]) -> str:
    facts: dict[str, bool] = {}
    for name in events:
        facts.update(EVENTS[name])
    return tenancy_state(TenancyFacts(**facts))


@pytest.mark.parametrize(
    ("events", "state"),
    [
        # Placed, failed or released before its deploy: the tenant never had the machine.
        ((), "not_deployed"),
        # The deploy went out with the tenant's keys: the machine is the tenant's, and stays so after a failure.
        (("deploy",), "open"),
        # Released through MAAS (the gateway revoked the host's allocation user, MAAS erased the disk), at the
        # allocation's release or at once after a failure that followed the deploy.
        (("deploy", "machine_released"), "machine_released"),
        # A release that failed leaves the tenancy open; the next allocation deployed to the node ends it.
        (("deploy", "superseded"), "superseded"),
        # A release result seen before the deploy (another durable) is an end already.
        (("machine_released",), "machine_released"),
    ],
)
def test_a_tenancy_opens_at_the_deploy_and_ends_when_the_machine_is_released(
    events: tuple[str, ...], state: str
) -> None:
    assert _after(events) == state


@pytest.mark.parametrize(
    "events",
    [
        ("deploy", "machine_released"),
        ("deploy", "superseded"),
        ("deploy", "superseded", "machine_released"),
    ],
)
def test_the_order_events_are_handled_in_does_not_change_the_judgement(events: tuple[str, ...]) -> None:
    assert {_after(order) for order in itertools.permutations(events)} == {_after(events)}


def test_a_stored_row_reads_back_as_its_facts_and_the_refusal_names_node_and_allocation() -> None:
    row = {"deployed": True, "machine_released": False, "superseded_by": None}
    assert tenancy_state(facts_of(row)) == "open"
    assert tenancy_state(facts_of({**row, "superseded_by": "a-later-allocation"})) == "superseded"
    assert tenancy_state(facts_of({**row, "deployed": False})) == "not_deployed"
    reason = refusal_reason("bm-7", ["alloc-1"])
    assert "bm-7" in reason and "alloc-1" in reason and "slice host" in reason
