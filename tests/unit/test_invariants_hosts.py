"""The independent checker's comparison of what the hosts and MAAS run with what the control plane believes
(pure: the inputs are what the databases, the simulated fleet and the MAAS simulator answer)."""

from __future__ import annotations

from typing import Any

from gpuaas_dev.testing.invariants import host_violations, lifecycle_violations, maas_violations, vm_name

A = "11111111-0000-4000-8000-000000000001"
B = "22222222-0000-4000-8000-000000000002"
BM = "33333333-0000-4000-8000-000000000003"


def alloc(allocation_id: str, state: str, node: str | None, shape: str = "gpu_slice", sid: str | None = None) -> dict:
    return {"allocation_id": allocation_id, "shape": shape, "state": state, "node_id": node, "maas_system_id": sid}


def claim(allocation_id: str, node: str, slot: str, gpu: str, vf: str, disk: str) -> dict:
    return {
        "allocation_id": allocation_id,
        "node_id": node,
        "slot_id": slot,
        "claim_kind": "slot",
        "gpu_pci_address": gpu,
        "fabric_vf_pci_address": vf,
        "nvme_by_id": disk,
    }


def dom(name: str, pci: list[str], disks: list[str], state: str = "running") -> dict[str, Any]:
    return {"name": name, "uuid": "u", "state": state, "pci": pci, "disks": disks}


CLAIM_A = claim(A, "n1", "n1-s0", "0000:18:00.0", "0000:19:00.1", "nvme-A0")
GOOD_VM = dom(vm_name(A), ["0000:18:00.0", "0000:19:00.1"], ["/root/dev/disk/by-id/nvme-A0"])


def test_one_vm_per_active_slice_with_its_claimed_devices_passes() -> None:
    allocations = [alloc(A, "active", "n1"), alloc(B, "released", "n2")]
    hosts = {"n1": {"domains": [GOOD_VM]}, "n2": {"domains": []}}
    assert host_violations(allocations, [CLAIM_A], hosts) == []


def test_a_missing_a_stray_a_doubled_and_a_misplaced_vm_are_reported() -> None:
    allocations = [alloc(A, "active", "n1"), alloc(B, "active", "n2")]
    stray = dom("gpuaas-deadbeef", [], [])
    hosts = {"n1": {"domains": [GOOD_VM, stray]}, "n2": {"domains": [GOOD_VM]}}
    found = host_violations(allocations, [CLAIM_A], hosts)
    assert found == [
        "VM gpuaas-deadbeef (running) on n1 belongs to no active slice allocation",
        f"VM {vm_name(A)} runs on n2 but {A} is placed on n1",
        f"VM {vm_name(A)} runs on 2 hosts: ['n1', 'n2']",
        f"active slice allocation {B} has no VM on n2",
    ]


def test_a_vm_with_other_devices_than_its_claims_or_not_running_is_reported() -> None:
    allocations = [alloc(A, "active", "n1")]
    vm = dom(vm_name(A), ["0000:2a:00.0"], ["/dev/other"], state="shutoff")
    found = host_violations(allocations, [CLAIM_A], {"n1": {"domains": [vm]}})
    assert found == [
        f"VM {vm_name(A)} of active {A} is shutoff",
        f"VM {vm_name(A)} holds PCI ['0000:2a:00.0'] but its claims name ['0000:18:00.0', '0000:19:00.1']",
        f"VM {vm_name(A)} lacks the disk nvme-A0 of its claimed slot n1-s0",
    ]


def test_a_vm_of_a_released_allocation_is_reported() -> None:
    assert host_violations([alloc(A, "released", "n1")], [], {"n1": {"domains": [GOOD_VM]}}) == [
        f"VM {vm_name(A)} (running) on n1 belongs to no active slice allocation"
    ]


def machine(sid: str, status: str, deploys: list[str], agent: str | None = None) -> dict[str, Any]:
    return {
        "system_id": sid,
        "status_name": status,
        "_sim": {"agent_name": agent, "deploys": [{"agent_name": d, "ago_seconds": 1.0} for d in deploys]},
    }


def test_one_deploy_per_baremetal_allocation_passes() -> None:
    allocations = [alloc(BM, "active", "bm1", "baremetal", "sid1"), alloc(B, "released", "bm2", "baremetal", "sid2")]
    machines = [machine("sid1", "Deployed", [BM], BM), machine("sid2", "Ready", [B]), machine("slice", "Deployed", [])]
    assert maas_violations(allocations, machines, {"sid1", "sid2"}) == []


def test_a_second_deploy_an_unknown_deploy_and_a_machine_nobody_holds_are_reported() -> None:
    allocations = [alloc(BM, "active", "bm1", "baremetal", "sid1"), alloc(B, "failed", "bm2", "baremetal", "sid2")]
    machines = [machine("sid1", "Deployed", [BM, "ghost"], BM), machine("sid2", "Deployed", [B, B], B)]
    assert maas_violations(allocations, machines, {"sid1", "sid2"}) == [
        "MAAS deployed ['sid1'] for 'ghost', an allocation the allocator does not know",
        f"allocation {B} was deployed 2 times: ['sid2', 'sid2']",
        f"machine sid2 is Deployed (for {B}) with no active allocation",
    ]


def test_a_failed_allocations_machine_left_in_failed_deployment_is_reported() -> None:
    allocations = [alloc(B, "failed", "bm2", "baremetal", "sid2"), alloc(A, "failed", "bm1", "baremetal", "sid1")]
    machines = [machine("sid2", "Failed deployment", [B], B), machine("sid1", "Ready", [A])]
    assert maas_violations(allocations, machines, {"sid1", "sid2"}) == [
        f"machine sid2 is left in Failed deployment (for {B})"
    ]


def test_an_active_baremetal_allocation_without_its_deploy_is_reported() -> None:
    allocations = [alloc(BM, "active", "bm1", "baremetal", "sid1")]
    assert maas_violations(allocations, [machine("sid1", "Deploying", [], None)], {"sid1"}) == [
        f"active baremetal {BM} on sid1 has deploys None",
        f"machine sid1 of active {BM} is Deploying",
        f"machine sid1 is deployed for None, not {BM}",
    ]


def test_a_lost_or_unsettled_allocation_is_reported() -> None:
    allocations = [alloc(A, "active", "n1"), alloc(B, "provisioning", "n1")]
    assert lifecycle_violations([A, B, BM], allocations) == [
        f"allocation {BM} was requested and the allocator has no record of it",
        f"allocation {B} is still provisioning",
    ]
