"""When a node is under a baremetal tenancy (image pipeline, domain/tenancy.py): every order in which the
pipeline may see an allocation's events leads to the same judgement."""

from __future__ import annotations

import itertools

import pytest

from gpuaas_image_pipeline.domain.tenancy import TenancyFacts, facts_of, refusal_reason, tenancy_state

# What each event the pipeline follows adds to an allocation's facts.
EVENTS = {
    "placed": {"started": True},
    "provisioning": {"started": True, "deploy_sent": True},
    "released": {"released": True},
    "failed": {"failed": True},
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
        ((), "not_started"),
        (("placed",), "open"),
        (("placed", "provisioning"), "open"),
        # Released through MAAS: the gateway revoked the host's allocation user, MAAS erased the disk.
        (("placed", "provisioning", "released"), "released"),
        # Failed before the deploy went out: the tenant never had the machine.
        (("placed", "failed"), "failed_before_deploy"),
        # Failed after the deploy: the machine may run the tenant's image until MAAS releases it.
        (("placed", "provisioning", "failed"), "open"),
        (("placed", "provisioning", "failed", "machine_released"), "machine_released"),
        # A release that failed leaves the tenancy open; the next allocation placed on the node ends it.
        (("placed", "provisioning", "failed", "superseded"), "superseded"),
        # A release result seen before the lifecycle (another durable, another stream) is an end already.
        (("machine_released",), "machine_released"),
    ],
)
def test_a_tenancy_opens_at_placement_and_ends_when_the_machine_is_released(
    events: tuple[str, ...], state: str
) -> None:
    assert _after(events) == state


@pytest.mark.parametrize(
    "events",
    [
        ("placed", "provisioning", "released"),
        ("placed", "provisioning", "failed", "machine_released"),
        ("placed", "failed"),
        ("placed", "provisioning", "failed"),
        ("placed", "provisioning", "failed", "superseded"),
    ],
)
def test_the_order_events_are_handled_in_does_not_change_the_judgement(events: tuple[str, ...]) -> None:
    assert {_after(order) for order in itertools.permutations(events)} == {_after(events)}


def test_a_stored_row_reads_back_as_its_facts_and_the_refusal_names_node_and_allocation() -> None:
    row = {
        "started": True,
        "deploy_sent": True,
        "released": False,
        "failed": True,
        "machine_released": False,
        "superseded_by": None,
    }
    assert tenancy_state(facts_of(row)) == "open"
    assert tenancy_state(facts_of({**row, "superseded_by": "a-later-allocation"})) == "superseded"
    reason = refusal_reason("bm-7", ["alloc-1"])
    assert "bm-7" in reason and "alloc-1" in reason and "slice host" in reason
