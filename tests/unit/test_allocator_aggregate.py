"""The allocation aggregate on its own: what its methods record, without a repository or a bus."""

from __future__ import annotations

import uuid

import pytest
from pydantic import SecretStr

from gpuaas_allocator.domain.allocation import Allocation
from gpuaas_allocator.domain.commands import Policy
from gpuaas_allocator.domain.model import ActiveImage, InvalidTransition
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m

POLICY = Policy(SecretStr("unit-test-enrolment-secret"), 1200.0, 60.0, "default", "h200-baremetal")
IMAGE = ActiveImage("ubuntu-slice", "slice", "h200-sxm-slice", "a" * 64, "/img/slice.raw")


def _message(type_: str, payload: m.Payload) -> Envelope:
    return Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="c")


def _accepted() -> Allocation:
    req = m.AllocationRequested(
        allocation_id=uuid.uuid4(),
        tenant_id="t",
        shape="gpu_slice",
        sku="h200-sxm-slice",
        gpu_count=1,
        image=IMAGE.slug,
        ssh_public_keys=["ssh-ed25519 AAAA k@t"],
        hostname="box",
    )
    return Allocation.request_accepted(req, IMAGE, "fp", POLICY, _message("allocation.requested", req))


def _placed(alloc: Allocation) -> m.PlacementPlaced:
    slot = m.SlotBinding(
        slot_id="n1-s0",
        gpu_pci_address="0000:18:00.0",
        nvme_by_id="nvme-x",
        fabric_vf_pci_address="0000:19:00.2",
        mac="52:54:00:00:00:01",
        private_ip="127.100.0.10",
        ovs_bridge="br-slice",
        profile="h200-slice",
    )
    return m.PlacementPlaced(
        allocation_id=alloc.allocation_id, node_id="n1", claim_mode="slots", slots=[slot], fencing_epoch=3
    )


def test_a_new_allocation_records_its_request_and_acceptance_in_timeline_order() -> None:
    alloc = _accepted()
    assert [(e.seq, e.state, e.previous_state) for e in alloc.timeline] == [
        (1, "requested", None),
        (2, "accepted", "requested"),
    ]
    (accepted,) = alloc.events
    assert accepted.type == "allocation.accepted" and accepted.payload.seq == 2  # type: ignore[attr-defined]
    assert alloc.is_new and alloc.changes["state"] == "accepted"


def test_a_reasked_provision_task_is_the_task_first_sent() -> None:
    alloc = _accepted()
    alloc.place(_placed(alloc))
    (first,) = [e for e in alloc.events if e.type == "slice.vm_provision"]
    alloc.events.clear()
    alloc.reask_task()
    (again,) = alloc.events
    assert again.type == "slice.vm_provision" and again.subject == {"node_id": "n1"}
    assert again.payload == first.payload, "same id, deadline, slots, image, keys and hostname"
    assert again.event_id != first.event_id, "a new message, or JetStream drops it as a duplicate"


def test_a_release_while_provisioning_waits_and_the_answer_starts_the_teardown() -> None:
    alloc = _accepted()
    alloc.place(_placed(alloc))
    alloc.release(m.AllocationReleaseRequested(allocation_id=alloc.allocation_id, reason="done"))
    assert alloc.state == "releasing" and alloc.release_task_id is None, "nothing torn down under a running task"
    alloc.take_task_result(
        m.NodeTaskResult(
            task_id=alloc.task_id,
            allocation_id=alloc.allocation_id,
            node_id="n1",
            task_type="slice.vm_provision",
            status="succeeded",
        )
    )
    teardown = [e for e in alloc.events if e.type == "slice.vm_release"]
    assert (
        len(teardown) == 1
        and alloc.awaiting_result
        and alloc.release_task_id == POLICY.release_task_id(alloc.allocation_id)
    )


def test_a_transition_the_table_forbids_is_refused() -> None:
    alloc = _accepted()
    with pytest.raises(InvalidTransition):
        alloc.fail("x", None, None)  # accepted -> failed is not in the table


def _provisioned(alloc: Allocation, phases: dict[str, float]) -> None:
    alloc.place(_placed(alloc))
    readiness = m.Readiness(
        mac="52:54:00:00:00:01",
        expected_ip="127.100.0.10",
        actual_ip="127.100.0.10",
        lease_state="bound",
        ssh_ready=True,
        phase_seconds=phases,
    )
    alloc.take_task_result(
        m.NodeTaskResult(
            task_id=alloc.task_id,
            allocation_id=alloc.allocation_id,
            node_id="n1",
            task_type="slice.vm_provision",
            status="succeeded",
            readiness=readiness,
        )
    )


def test_each_provisioning_phase_goes_on_the_timeline_with_its_seconds_before_active() -> None:
    alloc = _accepted()
    phases = {"seed": 0.02, "clone_image": 1.0, "define": 0.5, "wait_ready": 90.0, "lease": 37.2, "ssh": 10.2}
    _provisioned(alloc, phases)
    rows = [(e.state, e.reason_code, e.detail) for e in alloc.timeline]
    recorded = [(r[2]["phase"], r[2]["seconds"]) for r in rows if r[1] == "provision_phase"]
    assert recorded == list(phases.items())
    assert rows[-1][0] == "active" and all(r[0] == "provisioning" for r in rows if r[1] == "provision_phase")


@pytest.mark.parametrize("stop_path, code", [("graceful", "vm_stopped"), ("forced", "vm_stopped_hard")])
def test_a_release_says_on_the_timeline_how_the_vm_stopped(stop_path: str, code: str) -> None:
    alloc = _accepted()
    _provisioned(alloc, {})
    alloc.release(m.AllocationReleaseRequested(allocation_id=alloc.allocation_id, reason="done"))
    alloc.take_task_result(
        m.NodeTaskResult(
            task_id=alloc.release_task_id,
            allocation_id=alloc.allocation_id,
            node_id="n1",
            task_type="slice.vm_release",
            status="succeeded",
            stop_path=stop_path,
        )
    )
    noted = [e for e in alloc.timeline if e.reason_code == code]
    assert len(noted) == 1 and noted[0].detail["stop_path"] == stop_path
    assert alloc.timeline[-1].state == "released"
