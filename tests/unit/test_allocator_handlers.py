"""The allocator's handlers with an in-memory unit of work: the process-manager rules without servers."""

from __future__ import annotations

import copy
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from gpuaas_allocator.domain.allocation import HOST_NOTES_PER_ALLOCATION
from gpuaas_allocator.domain.model import ActiveImage
from gpuaas_allocator.service_layer.commands import provision_task_id, release_task_id
from gpuaas_allocator.service_layer.deadlines import expire_overdue_tasks
from gpuaas_allocator.service_layer.handlers import Allocator
from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.bus import HandlerContext, PermanentError, deliver
from gpuaas_common.contract import Envelope, derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.enrolment import enrolment_proof
from gpuaas_common.unit_of_work import FakeUnitOfWork
from tests.fakes.allocator import FakeAllocationRepository

SLICE_IMAGE = ActiveImage("ubuntu-slice", "slice", "h200-sxm-slice", "a" * 64, "/img/slice.raw")
HOST_IMAGE = ActiveImage("ubuntu-host", "host", "h200-sxm", "b" * 64, "custom/ubuntu-host")
SECRET = "unit-test-enrolment-secret"


def _prov(alloc: uuid.UUID) -> str:
    return provision_task_id(AllocatorSettings(enrolment_secret=SECRET), alloc)


def _rel(alloc: uuid.UUID) -> str:
    return release_task_id(AllocatorSettings(enrolment_secret=SECRET), alloc)


class World:
    """One allocator, one fake repository, and every event it committed, message by message."""

    def __init__(self) -> None:
        self.repo = FakeAllocationRepository(SLICE_IMAGE, HOST_IMAGE)
        self.allocator = Allocator(AllocatorSettings(enrolment_secret=SECRET))
        self.inbox: set[tuple[str, str]] = set()
        self.events: list[Envelope] = []

    async def send(self, handler, type_: str, payload: m.Payload, consumer: str = "test") -> list[Envelope]:
        env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="test", correlation_id="c")
        uow = FakeUnitOfWork(self.repo, "allocator", seen=self.inbox)
        await deliver(handler, HandlerContext(env, payload, "subject", consumer, 1), uow)
        self.events.extend(uow.published)
        return uow.published

    async def sweep(self) -> int:
        """One pass of the allocator's deadline sweep, each batch in its own fake unit of work."""
        uows: list[FakeUnitOfWork[FakeAllocationRepository]] = []

        def factory() -> FakeUnitOfWork[FakeAllocationRepository]:
            uows.append(FakeUnitOfWork(self.repo, "allocator"))
            return uows[-1]

        n = await expire_overdue_tasks(factory, self.allocator.settings)
        for uow in uows:
            self.events.extend(uow.published)
        return n

    def state(self, alloc: uuid.UUID) -> str:
        return self.repo.allocations[alloc]["state"]

    def lifecycle_events(self) -> int:
        return sum(1 for e in self.events if e.type.startswith("allocation."))

    def sent(self, type_: str) -> list[dict[str, Any]]:
        return [e.payload for e in self.events if e.type == type_]

    async def request(self, shape: str = "gpu_slice") -> uuid.UUID:
        alloc = uuid.uuid4()
        sku, image, gpus = ("h200-sxm-slice", SLICE_IMAGE, 1) if shape == "gpu_slice" else ("h200-sxm", HOST_IMAGE, 8)
        await self.send(
            self.allocator.on_requested,
            "allocation.requested",
            m.AllocationRequested(
                allocation_id=alloc,
                tenant_id="t",
                shape=shape,
                sku=sku,
                gpu_count=gpus,
                image=image.slug,
                ssh_public_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIUnit unit@test"],
            ),
        )
        return alloc

    async def place(self, alloc: uuid.UUID, shape: str = "gpu_slice", wipe_policy: str | None = None) -> None:
        slots = (
            [
                m.SlotBinding(
                    slot_id="n1-s0",
                    gpu_pci_address="0000:18:00.0",
                    nvme_by_id="nvme-x",
                    fabric_vf_pci_address="0000:19:00.2",
                    mac="52:54:00:00:00:01",
                    private_ip="127.100.0.10",
                    ovs_bridge="br-slice",
                    profile="h200-slice",
                )
            ]
            if shape == "gpu_slice"
            else []
        )
        await self.send(
            self.allocator.on_placed,
            "placement.placed",
            m.PlacementPlaced(
                allocation_id=alloc,
                node_id="n1",
                claim_mode="slots" if slots else "node_exclusive",
                slots=slots,
                fencing_epoch=1,
                maas_system_id=None if slots else "abc123",
                wipe_policy=wipe_policy,  # type: ignore[arg-type]
            ),
        )


@pytest.fixture
def world() -> World:
    return World()


async def test_a_release_while_provisioning_waits_for_the_result_then_tears_down(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    task = world.sent("slice.vm_provision")[0]
    assert world.state(alloc) == "provisioning"

    await world.send(
        world.allocator.on_release_requested,
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc),
    )
    assert world.state(alloc) == "releasing"
    assert world.sent("slice.vm_release") == [], "the teardown must not race the provision still in flight"

    await world.send(
        world.allocator.on_task_result,
        "node.task_result",
        m.NodeTaskResult(
            task_id=task["task_id"],
            allocation_id=alloc,
            node_id="n1",
            task_type="slice.vm_provision",
            status="succeeded",
        ),
    )
    assert world.state(alloc) == "releasing", "a VM that came up after the release request is never handed out"
    assert not world.sent("allocation.active")
    release = world.sent("slice.vm_release")
    assert len(release) == 1 and release[0]["slots"][0]["slot_id"] == "n1-s0"


async def test_a_release_before_placement_frees_without_touching_a_host(world: World) -> None:
    alloc = await world.request()
    await world.send(
        world.allocator.on_release_requested,
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc),
    )
    await world.place(alloc)
    assert world.state(alloc) == "released"
    assert world.sent("slice.vm_provision") == [] and world.sent("slice.vm_release") == []


def _enrolled(alloc: uuid.UUID, secret: str = SECRET, machine: str = "abc123") -> m.NodeEnrolled:
    """The deployed host's enrolment, its proof minted with `secret` for `machine`."""
    return m.NodeEnrolled(
        node_id="n1",
        kind="baremetal",
        hostname="bm",
        agent_version="t",
        maas_system_id="abc123",
        allocation_id=alloc,
        enrolment_proof=enrolment_proof(secret, str(alloc), machine),
    )


async def _deployed_baremetal(world: World, wipe_policy: str | None = None) -> uuid.UUID:
    alloc = await world.request("baremetal")
    await world.place(alloc, "baremetal", wipe_policy)
    op = world.sent("maas.deploy_requested")[-1]
    await world.send(
        world.allocator.on_maas_result,
        "maas.deploy_result",
        m.MaasDeployResult(
            operation_id=op["operation_id"],
            allocation_id=alloc,
            system_id="abc123",
            node_id="n1",
            status="deployed",
            resolution="direct",
            attempts=1,
            ip_addresses=["127.100.0.50"],
            login_user="ubuntu",
        ),
    )
    assert world.state(alloc) == "provisioning"  # deployed, but its agent has not proven itself yet
    return alloc


@pytest.mark.parametrize(
    "secret, machine, becomes_active",
    [
        (SECRET, "abc123", True),
        ("another-secret", "abc123", False),  # minted by someone without our secret
        (SECRET, "other-machine", False),  # a proof for another machine replayed here
    ],
)
async def test_a_baremetal_host_goes_active_only_with_the_right_enrolment_proof(
    world: World,
    secret: str,
    machine: str,
    becomes_active: bool,
) -> None:
    alloc = await _deployed_baremetal(world)
    await world.send(world.allocator.on_enrolled, "node.enrolled", _enrolled(alloc, secret, machine))
    assert (world.state(alloc) == "active") is becomes_active
    assert bool(world.sent("allocation.active")) is becomes_active
    if not becomes_active:
        # The machine's own announcement with a proof that is not this allocation's: its user-data was not what
        # the gateway sent. Nobody would send a better one, so it fails now and the machine goes back to MAAS.
        row = world.repo.allocations[alloc]
        assert (world.state(alloc), row["failure_code"]) == ("failed", "enrolment_refused")
        assert [r["system_id"] for r in world.sent("maas.release_requested")] == ["abc123"]


async def test_the_deploy_carries_the_tenants_keys_and_active_says_where_and_as_whom_to_log_in(world: World) -> None:
    alloc = await _deployed_baremetal(world)
    (deploy,) = world.sent("maas.deploy_requested")
    assert deploy["ssh_public_keys"] == ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIUnit unit@test"]
    await world.send(
        world.allocator.on_enrolled, "node.enrolled", _enrolled(alloc).model_copy(update={"boot_seconds": 41.5})
    )
    (active,) = world.sent("allocation.active")
    assert {k: active["access"][k] for k in ("ip", "user", "port", "maas_system_id")} == {
        "ip": "127.100.0.50",
        "user": "ubuntu",
        "port": 22,
        "maas_system_id": "abc123",
    }
    phases = {
        e["detail"]["phase"]: e["detail"]["seconds"]
        for e in world.repo.entries
        if e["allocation_id"] == alloc and e.get("reason_code") == "provision_phase"
    }
    assert set(phases) == {"allocate", "deploy", "first_boot", "enrolment", "active"}
    assert phases["first_boot"] == 41.5  # the host's own count
    assert all(v >= 0 for v in phases.values())


async def test_an_announcement_for_another_machine_is_kept_on_the_timeline_and_changes_nothing(world: World) -> None:
    alloc = await _deployed_baremetal(world)
    other = _enrolled(alloc).model_copy(update={"node_id": "n2", "maas_system_id": "xyz789"})
    await world.send(world.allocator.on_enrolled, "node.enrolled", other)
    assert world.state(alloc) == "provisioning" and not world.sent("maas.release_requested")
    (note,) = [e for e in world.repo.entries if e.get("reason_code") == "enrolment_refused"]
    assert note["detail"]["node_id"] == "n2"


async def test_a_tenants_machine_announcing_itself_as_a_slice_host_is_refused_on_its_timeline(world: World) -> None:
    alloc = await _deployed_baremetal(world)
    slice_like = m.NodeEnrolled(node_id="n1", kind="slice_host", hostname="bm", agent_version="t")
    await world.send(world.allocator.on_enrolled, "node.enrolled", slice_like)
    assert world.state(alloc) == "provisioning"
    (note,) = [e for e in world.repo.entries if e.get("reason_code") == "slice_enrolment_refused"]
    assert (note["allocation_id"], note["detail"]["node_id"]) == (alloc, "n1")
    # A slice host that holds no tenant's machine enrols with no word from the allocator.
    before = len(world.repo.entries)
    await world.send(world.allocator.on_enrolled, "node.enrolled", slice_like.model_copy(update={"node_id": "n9"}))
    assert len(world.repo.entries) == before


async def test_a_machine_announcing_itself_again_and_again_writes_only_so_many_notes(world: World) -> None:
    """N2: each refused announcement was a timeline row for good; past HOST_NOTES_PER_ALLOCATION only logs."""
    alloc = await _deployed_baremetal(world)
    slice_like = m.NodeEnrolled(node_id="n1", kind="slice_host", hostname="bm", agent_version="t")
    for _ in range(HOST_NOTES_PER_ALLOCATION + 20):
        await world.send(world.allocator.on_enrolled, "node.enrolled", slice_like)
    notes = [e for e in world.repo.entries if e.get("reason_code") == "slice_enrolment_refused"]
    assert len(notes) == HOST_NOTES_PER_ALLOCATION
    assert world.repo.allocations[alloc]["host_notes"] == HOST_NOTES_PER_ALLOCATION
    assert world.state(alloc) == "provisioning"


async def test_a_result_for_a_task_never_sent_changes_nothing(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    before = copy.deepcopy(world.repo.allocations[alloc])
    env_count = len(world.events)
    with pytest.raises(PermanentError) as err:
        await world.send(
            world.allocator.on_task_result,
            "node.task_result",
            m.NodeTaskResult(
                task_id="rel-forged",
                allocation_id=alloc,
                node_id="n1",
                task_type="slice.vm_release",
                status="succeeded",
            ),
        )
    assert err.value.reason_code == "unknown_task"
    assert world.repo.allocations[alloc] == before and len(world.events) == env_count


async def test_the_same_message_twice_has_one_effect(world: World) -> None:
    alloc = uuid.uuid4()
    req = m.AllocationRequested(
        allocation_id=alloc,
        tenant_id="t",
        shape="gpu_slice",
        sku="h200-sxm-slice",
        gpu_count=1,
        image=SLICE_IMAGE.slug,
        ssh_public_keys=["ssh-ed25519 AAAA k@t"],
    )
    env = Envelope.wrap("allocation.requested", req.model_dump(mode="json"), producer="test", correlation_id="c")
    for _ in range(2):
        uow = FakeUnitOfWork(world.repo, "allocator", seen=world.inbox)
        await deliver(world.allocator.on_requested, HandlerContext(env, req, "s", "allocator-requested", 1), uow)
        world.events.extend(uow.published)
    assert [e.type for e in world.events] == ["allocation.accepted"]


# --- deadlines owned by the control plane ---------------------------------------------------------------


def test_the_default_slice_task_deadline_is_twenty_minutes() -> None:
    # slice-node-bootstrap: "Increased the deployed provisioning node-task TTL to 20m".
    assert AllocatorSettings().task_deadline_s == 20 * 60


def _overdue(world: World, alloc: uuid.UUID, minutes: float = 30) -> None:
    world.repo.allocations[alloc]["task_deadline_at"] = datetime.now(timezone.utc) - timedelta(minutes=minutes)


async def _asked_again_and_silent(world: World, alloc: uuid.UUID, task_type: str) -> None:
    """The first overdue pass sends the task once more (same task id) and waits; then it is overdue again."""
    sent = len(world.sent(task_type))
    _overdue(world, alloc)
    assert await world.sweep() == 1
    assert world.state(alloc) in ("provisioning", "releasing")
    again = world.sent(task_type)
    assert len(again) == sent + 1 and again[-1]["task_id"] == again[0]["task_id"]
    _overdue(world, alloc)


def _result(alloc: uuid.UUID, task_id: str, status: str = "succeeded", **kw: Any) -> m.NodeTaskResult:
    task_type = "slice.vm_release" if task_id.startswith("rel-") else "slice.vm_provision"
    return m.NodeTaskResult(
        task_id=task_id, allocation_id=alloc, node_id="n1", task_type=task_type, status=status, **kw
    )


async def test_the_provision_task_carries_the_deadline_the_allocator_keeps(world: World) -> None:
    alloc = await world.request()
    before = datetime.now(timezone.utc)
    await world.place(alloc)
    task = world.sent("slice.vm_provision")[0]
    kept = world.repo.allocations[alloc]["task_deadline_at"]
    assert kept is not None and kept.isoformat().replace("+00:00", "Z")[:19] == task["deadline"][:19]
    assert timedelta(minutes=19) < kept - before <= timedelta(minutes=20, seconds=1)


@pytest.mark.parametrize(
    "strategy, version", [("cloud_init", None), ("preinstalled", None), ("preinstalled", "580.159.04")]
)
async def test_the_provision_task_carries_the_driver_strategy_the_pipeline_announced(
    world: World, strategy: str, version: str | None
) -> None:
    await world.send(
        world.allocator.on_image_activated,
        "image.activated",
        m.ImageActivated(
            slug=SLICE_IMAGE.slug,
            kind="slice",
            sku="h200-sxm-slice",
            digest_sha256="c" * 64,
            image_path="/img/slice-2.raw",
            driver_strategy=strategy,
            driver_version=version,
        ),
    )
    alloc = await world.request()
    # Placement learns the guest's driver version with the request (the Fabric Manager version gate, issue 29).
    (accepted,) = [e for e in world.sent("allocation.accepted") if e["allocation_id"] == str(alloc)]
    assert accepted["image"]["driver_version"] == version
    await world.place(alloc)
    (task,) = world.sent("slice.vm_provision")
    assert task["image"] == {
        "slug": SLICE_IMAGE.slug,
        "digest_sha256": "c" * 64,
        "image_path": "/img/slice-2.raw",
        "driver_strategy": strategy,
        "driver_version": version,
    }


async def test_a_silent_host_fails_the_allocation_at_the_deadline_and_keeps_the_slots_for_cleanup(
    world: World,
) -> None:
    alloc = await world.request()
    await world.place(alloc)
    assert await world.sweep() == 0, "nothing is overdue before the deadline"
    assert world.state(alloc) == "provisioning"

    await _asked_again_and_silent(world, alloc, "slice.vm_provision")
    assert await world.sweep() == 1
    assert world.state(alloc) == "failed"
    failed = world.sent("allocation.failed")
    assert len(failed) == 1
    assert failed[0]["reason_code"] == "task_deadline_passed"
    # cleanup_required: the scheduler keeps the claims and moves the slots to cleanup_blocked, never available.
    assert failed[0]["cleanup_required"] is True and failed[0]["node_id"] == "n1"
    entry = [e for e in world.repo.entries if e["allocation_id"] == alloc][-1]
    assert (entry["state"], entry["reason_code"]) == ("failed", "task_deadline_passed")
    assert entry["detail"]["task_id"] == _prov(alloc)
    assert world.repo.allocations[alloc]["timed_out_task_id"] == _prov(alloc)
    assert await world.sweep() == 0, "a task is timed out once"
    assert len(world.sent("allocation.failed")) == 1


async def test_the_deadline_sweep_waits_out_the_grace_the_agent_has_to_answer_itself(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    _overdue(world, alloc, minutes=0.5)  # past the deadline but within the 60 s grace
    assert await world.sweep() == 0 and world.state(alloc) == "provisioning"


async def test_a_silent_host_during_release_fails_it_with_cleanup_required(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    await world.send(
        world.allocator.on_release_requested,
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc),
    )
    assert world.sent("slice.vm_release") and world.state(alloc) == "releasing"
    await _asked_again_and_silent(world, alloc, "slice.vm_release")
    assert await world.sweep() == 1
    assert world.state(alloc) == "failed"
    failed = world.sent("allocation.failed")[0]
    assert (failed["reason_code"], failed["cleanup_required"]) == ("task_deadline_passed", True)
    assert world.repo.allocations[alloc]["timed_out_task_id"] == _rel(alloc)


async def test_a_provision_a_restart_interrupted_passes_its_wipe_proofs_on_for_the_scheduler_to_judge(
    world: World,
) -> None:
    """Before, the agent's `cleanup_required=False` (it had wiped the disk itself) went out as "the disk was
    never touched", and the scheduler made the slots available without seeing the proof."""
    alloc = await world.request()
    await world.place(alloc)
    proof = m.WipeProof(device="nvme-x", method="zero_fill", verified=True, verification="sampled zeros")
    interrupted = _result(
        alloc, _prov(alloc), "failed", reason_code="image_not_cached", disk_touched=True, wipe_proofs=[proof]
    )
    await world.send(world.allocator.on_task_result, "node.task_result", interrupted)
    [failed] = world.sent("allocation.failed")
    assert failed["cleanup_required"] is True
    # Passed on as the host made it: judging it is the scheduler's, which knows the site's policy.
    assert failed["wipe_proofs"] == [proof.model_dump(mode="json")]


@pytest.mark.parametrize(
    ("said", "cleanup_required"),
    [({"disk_touched": False}, False), ({"disk_touched": True}, True), ({}, True)],
    ids=["untouched", "touched", "not said"],
)
async def test_only_a_provision_that_says_it_never_wrote_the_disk_fails_without_cleanup(
    world: World, said: dict[str, bool], cleanup_required: bool
) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await world.send(
        world.allocator.on_task_result,
        "node.task_result",
        _result(alloc, _prov(alloc), "refused", reason_code="ovs_bridge_missing", **said),
    )
    assert [f["cleanup_required"] for f in world.sent("allocation.failed")] == [cleanup_required]


async def test_a_failed_release_passes_its_wipe_proofs_on(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    await world.send(
        world.allocator.on_release_requested,
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc),
    )
    proof = m.WipeProof(device="nvme-x", method="blkdiscard", verified=False, detail="signatures remain")
    await world.send(
        world.allocator.on_task_result,
        "node.task_result",
        _result(alloc, _rel(alloc), "failed", reason_code="wipe_unverified", wipe_proofs=[proof]),
    )
    [failed] = world.sent("allocation.failed")
    assert (failed["cleanup_required"], failed["wipe_proofs"]) == (True, [proof.model_dump(mode="json")])


async def test_a_baremetal_deploy_is_not_timed_out_by_the_node_task_sweep(world: World) -> None:
    alloc = await world.request("baremetal")
    await world.place(alloc, "baremetal")
    world.repo.allocations[alloc]["created_at"] = datetime.now(timezone.utc) - timedelta(hours=2)
    assert await world.sweep() == 0 and world.state(alloc) == "provisioning"


async def test_a_late_answer_after_the_deadline_is_recorded_not_applied_and_not_dead_lettered(
    world: World,
) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await _asked_again_and_silent(world, alloc, "slice.vm_provision")
    await world.sweep()
    events = len(world.events)

    # A failure that arrives late changes nothing: its slots already wait for cleanup.
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc), status="failed"))
    assert world.state(alloc) == "failed" and len(world.events) == events
    late = world.repo.entries[-1]
    assert (late["state"], late["previous_state"], late["reason_code"]) == (
        "failed",
        "failed",
        "late_task_result_ignored",
    )
    assert late["detail"]["task_id"] == _prov(alloc) and late["detail"]["status"] == "failed"

    # ...whereas a task the allocator never sent is still dead-lettered.
    with pytest.raises(PermanentError) as err:
        await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, "prov-forged"))
    assert err.value.reason_code == "unknown_task"


async def test_a_vm_built_after_its_allocation_failed_is_torn_down_and_the_answer_kept(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await _asked_again_and_silent(world, alloc, "slice.vm_provision")
    await world.sweep()
    lifecycle = world.lifecycle_events()

    # The host built it after all: the allocation stays failed, the VM it runs for nobody gets the teardown.
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    assert world.state(alloc) == "failed"
    assert world.repo.entries[-1]["reason_code"] == "late_task_result_ignored"
    teardown = world.sent("slice.vm_release")
    assert [(t["task_id"], t["node_id"], t["vm_name"]) for t in teardown] == [
        (_rel(alloc), "n1", f"gpuaas-{str(alloc)[:8]}")
    ]
    # The same late answer again (a redelivery under a new id) sends no second teardown.
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    assert len(world.sent("slice.vm_release")) == 1

    proof = m.WipeProof(device="/dev/disk/by-id/nvme-x", method="blkdiscard", verified=True)
    await world.send(
        world.allocator.on_task_result, "node.task_result", _result(alloc, _rel(alloc), wipe_proofs=[proof])
    )
    row = world.repo.allocations[alloc]
    assert (row["state"], row["awaiting_result"]) == ("failed", False)
    kept = world.repo.entries[-1]
    assert (kept["state"], kept["reason_code"], kept["detail"]["status"]) == (
        "failed",
        "late_vm_torn_down",
        "succeeded",
    )
    assert kept["detail"]["wipe_proofs"][0]["verified"] is True
    assert world.lifecycle_events() == lifecycle, "no lifecycle event"
    assert await world.sweep() == 0


async def test_an_unanswered_teardown_of_a_late_vm_is_asked_once_more_then_left_to_ops(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await _asked_again_and_silent(world, alloc, "slice.vm_provision")
    await world.sweep()
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))

    # Its own re-ask, not used up by the provision's: the same task once more, then silence.
    _overdue(world, alloc)
    assert await world.sweep() == 1
    assert [t["task_id"] for t in world.sent("slice.vm_release")] == [_rel(alloc)] * 2
    assert world.repo.allocations[alloc]["awaiting_result"]
    _overdue(world, alloc)
    assert await world.sweep() == 1
    row = world.repo.allocations[alloc]
    assert (row["state"], row["awaiting_result"]) == ("failed", False)
    assert world.repo.entries[-1]["reason_code"] == "late_vm_teardown_unanswered"
    assert len(world.sent("allocation.failed")) == 1, "failed once, never again"
    assert await world.sweep() == 0


async def test_an_answer_in_time_stops_the_deadline(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    _overdue(world, alloc)
    assert await world.sweep() == 0 and world.state(alloc) == "active"


async def _release(world: World, alloc: uuid.UUID) -> list[Envelope]:
    return await world.send(
        world.allocator.on_release_requested,
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc),
    )


async def test_a_release_the_allocator_cannot_act_on_is_answered_at_once_and_changes_nothing(world: World) -> None:
    unknown = uuid.uuid4()
    (answer,) = await _release(world, unknown)
    assert answer.type == "allocation.release_rejected"
    assert (answer.payload["reason_code"], answer.payload["state"], answer.payload["tenant_id"]) == (
        "unknown_allocation",
        None,
        None,
    )
    assert world.repo.allocations == {}, "a refused release leaves no row behind"

    alloc = await world.request()
    await _release(world, alloc)
    await world.place(alloc)  # released before provisioning: nothing to tear down
    assert world.state(alloc) == "released"
    timeline = len(world.repo.timeline)
    (again,) = await _release(world, alloc)
    assert again.type == "allocation.release_rejected"
    assert (again.payload["reason_code"], again.payload["state"], again.payload["tenant_id"]) == (
        "already_released",
        "released",
        "t",
    )
    assert world.state(alloc) == "released" and len(world.repo.timeline) == timeline


async def test_a_second_release_while_releasing_says_so_and_starts_nothing_new(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await _release(world, alloc)
    assert world.state(alloc) == "releasing"
    (answer,) = await _release(world, alloc)
    assert (answer.type, answer.payload["reason_code"]) == ("allocation.release_rejected", "already_releasing")
    assert world.sent("allocation.releasing") and len(world.sent("allocation.releasing")) == 1


async def test_the_same_refused_release_redelivered_is_answered_once(world: World) -> None:
    env = Envelope.wrap(
        "allocation.release_requested",
        {"allocation_id": str(uuid.uuid4())},
        producer="test",
        correlation_id="c",
    )
    payload = m.AllocationReleaseRequested.model_validate(env.payload)
    ids = []
    for _ in range(2):
        uow = FakeUnitOfWork(world.repo, "allocator", seen=world.inbox)
        await deliver(world.allocator.on_release_requested, HandlerContext(env, payload, "subject", "test", 1), uow)
        ids += [e.event_id for e in uow.published]
    assert len(ids) == 1, "the inbox drops the redelivery; the derived event id would dedup a relay repeat"


async def test_a_teardown_answered_for_an_allocation_still_active_releases_it(world: World) -> None:
    """The commit that started the release was lost after its task went out (a database that acknowledged it,
    then crashed): the host's answer is the only trace left, and the VM is gone, so the allocation cannot stay
    active."""
    alloc = await world.request()
    await world.place(alloc)
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    assert world.state(alloc) == "active"
    proof = m.WipeProof(device="nvme-x", method="blkdiscard", verified=True)
    await world.send(
        world.allocator.on_task_result, "node.task_result", _result(alloc, _rel(alloc), wipe_proofs=[proof])
    )
    assert world.state(alloc) == "released"
    (releasing,) = world.sent("allocation.releasing")
    (released,) = world.sent("allocation.released")
    assert released["cleanup"]["verified"] is True and released["seq"] == releasing["seq"] + 1
    assert [e["reason_code"] for e in world.repo.entries if e["state"] == "releasing"] == ["release_commit_lost"]


async def test_a_teardown_answer_from_another_host_or_a_foreign_task_still_changes_nothing(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    other = uuid.uuid4()
    for res in (
        _result(alloc, _rel(alloc)).model_copy(update={"node_id": "n2"}),
        _result(alloc, _rel(other)),
    ):
        with pytest.raises(PermanentError):
            await world.send(world.allocator.on_task_result, "node.task_result", res)
    assert world.state(alloc) == "active" and not world.sent("allocation.releasing")


async def test_a_release_asked_again_after_its_commits_were_lost_sends_a_teardown_jetstream_keeps(
    world: World,
) -> None:
    """Releasing and released were both committed, then lost with the host's answer already consumed: the row is
    active again and only a new release request can move it. Its teardown must be a new message (the first one's
    id would be dropped by JetStream's duplicate window) for the same task, which the agent answers from its
    record."""
    alloc = await world.request()
    await world.place(alloc)
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    before = copy.deepcopy(world.repo.allocations[alloc])
    first = [e for e in await _release(world, alloc) if e.type == "slice.vm_release"]
    world.repo.allocations[alloc] = before  # the database came back without the release's commits
    again = [e for e in await _release(world, alloc) if e.type == "slice.vm_release"]
    assert len(first) == len(again) == 1
    assert first[0].payload["task_id"] == again[0].payload["task_id"] == _rel(alloc)
    assert first[0].event_id != again[0].event_id
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _rel(alloc)))
    assert world.state(alloc) == "released"


async def test_a_transition_made_again_after_a_lost_commit_is_a_new_event_and_a_redelivery_is_the_same(
    world: World,
) -> None:
    """`released` was committed and published, then the commit was lost (and with it, downstream, the scheduler's
    commit of that event): the re-asked task's answer moves the allocation to `released` again under the same
    sequence number. That event must carry a new id, or JetStream drops it as a duplicate and the scheduler
    keeps the claims (chaos run, seed 1). The same answer delivered again keeps its id."""
    alloc = await world.request()
    await world.place(alloc)
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc)))
    await _release(world, alloc)
    releasing = copy.deepcopy(world.repo.allocations[alloc])
    timeline, entries = list(world.repo.timeline), list(world.repo.entries)
    answer = _result(alloc, _rel(alloc))
    env = Envelope.wrap("node.task_result", answer.model_dump(mode="json"), producer="test", correlation_id="c")

    async def deliver_fresh(envelope: Envelope) -> list[Envelope]:
        # The database lost the commit of `released`: the row, its timeline entry and the inbox row.
        world.repo.allocations[alloc] = copy.deepcopy(releasing)
        world.repo.timeline, world.repo.entries = list(timeline), list(entries)
        uow = FakeUnitOfWork(world.repo, "allocator", seen=set())
        await deliver(world.allocator.on_task_result, HandlerContext(envelope, answer, "s", "test", 1), uow)
        return [e for e in uow.published if e.type == "allocation.released"]

    (first,) = await deliver_fresh(env)
    (redelivered,) = await deliver_fresh(env)
    again = Envelope.wrap("node.task_result", answer.model_dump(mode="json"), producer="test", correlation_id="c")
    (reasked,) = await deliver_fresh(again)
    assert first.payload["seq"] == redelivered.payload["seq"] == reasked.payload["seq"]
    assert first.event_id == redelivered.event_id
    assert reasked.event_id != first.event_id


def _maas_result(
    alloc: uuid.UUID, kind: str, operation_id: str, status: str, *, erase_outcome: str | None = "erased"
) -> tuple[str, m.Payload]:
    model = m.MaasDeployResult if kind == "deploy" else m.MaasReleaseResult
    # A gateway's release result says which erase ran and how MAAS read it back.
    erase = {"erase_mode": "full", "erase_outcome": erase_outcome} if kind == "release" else {}
    return f"maas.{kind}_result", model(
        **erase,
        operation_id=operation_id,
        allocation_id=alloc,
        system_id="abc123",
        node_id="n1",
        status=status,
        resolution="polled",
        maas_status_name={"deployed": "Deployed", "released": "Ready"}.get(status, "Failed deployment"),
        attempts=1,
    )


async def test_a_machine_whose_deploy_failed_is_released_through_maas_and_the_answer_kept(world: World) -> None:
    alloc = await world.request("baremetal")
    await world.place(alloc, "baremetal")
    deploy = world.sent("maas.deploy_requested")[0]["operation_id"]
    await world.send(world.allocator.on_maas_result, *_maas_result(alloc, "deploy", deploy, "failed"))

    assert world.state(alloc) == "failed" and world.sent("allocation.failed")[0]["cleanup_required"] is True
    release = world.sent("maas.release_requested")
    assert [(r["operation_id"], r["system_id"]) for r in release] == [(f"release-{alloc}", "abc123")]
    lifecycle = world.lifecycle_events()

    await world.send(world.allocator.on_maas_result, *_maas_result(alloc, "release", f"release-{alloc}", "released"))
    row = world.repo.allocations[alloc]
    assert (row["state"], row["awaiting_result"]) == ("failed", False)
    kept = world.repo.entries[-1]
    assert (kept["state"], kept["reason_code"], kept["detail"]["maas_status_name"]) == (
        "failed",
        "machine_released_after_failure",
        "Ready",
    )
    assert world.lifecycle_events() == lifecycle, "no lifecycle event"
    assert len(world.sent("maas.release_requested")) == 1


async def test_a_forced_release_while_maas_deploys_releases_the_machine_once(world: World) -> None:
    alloc = await world.request("baremetal")
    await world.place(alloc, "baremetal")
    deploy = world.sent("maas.deploy_requested")[0]["operation_id"]
    forced = m.PlacementForceReleased(
        allocation_id=alloc, node_ids=["n1"], actor="ops", reason="machine stuck", forced=True
    )
    await world.send(world.allocator.on_force_released, "placement.force_released", forced)
    assert world.state(alloc) == "failed"
    assert [r["operation_id"] for r in world.sent("maas.release_requested")] == [f"release-{alloc}"]

    # The deploy MAAS had under way finishes after all: recorded, the allocation stays failed, no second release.
    await world.send(world.allocator.on_maas_result, *_maas_result(alloc, "deploy", deploy, "deployed"))
    assert world.state(alloc) == "failed" and world.repo.entries[-1]["reason_code"] == "late_deploy_result"
    assert len(world.sent("maas.release_requested")) == 1
    assert world.sent("allocation.active") == []


async def test_a_failed_slice_allocation_sends_no_machine_release(world: World) -> None:
    alloc = await world.request()
    await world.place(alloc)
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, _prov(alloc), status="failed"))
    assert world.state(alloc) == "failed" and world.sent("maas.release_requested") == []


@pytest.mark.parametrize("outcome", [None, "unconfirmed"])
async def test_a_machine_released_without_a_confirmed_erase_fails_the_release_and_stays_drained(
    world: World, outcome: str | None
) -> None:
    """`released` alone (an older or a compromised gateway, no erase read back) never frees the machine."""
    alloc = await _deployed_baremetal(world)
    await world.send(world.allocator.on_enrolled, "node.enrolled", _enrolled(alloc))
    await world.send(
        world.allocator.on_release_requested,
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc),
    )
    operation = world.sent("maas.release_requested")[0]["operation_id"]
    result = _maas_result(alloc, "release", operation, "released", erase_outcome=outcome)
    await world.send(world.allocator.on_maas_result, *result)
    assert world.state(alloc) == "failed"
    (failed,) = world.sent("allocation.failed")
    assert (failed["reason_code"], failed["cleanup_required"]) == ("disk_erase_unconfirmed", True)
    assert world.sent("allocation.released") == []


async def test_a_release_answered_twice_is_applied_once_and_the_repeat_acknowledged(world: World) -> None:
    alloc = await _deployed_baremetal(world)
    await world.send(world.allocator.on_enrolled, "node.enrolled", _enrolled(alloc))
    assert world.state(alloc) == "active"
    await world.send(
        world.allocator.on_release_requested,
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc),
    )
    operation = world.sent("maas.release_requested")[0]["operation_id"]
    await world.send(world.allocator.on_maas_result, *_maas_result(alloc, "release", operation, "released"))
    assert world.state(alloc) == "released"
    events = len(world.events)

    # The command was asked again before its first answer was applied: the gateway answers the repeat too.
    await world.send(world.allocator.on_maas_result, *_maas_result(alloc, "release", operation, "released"))
    assert world.state(alloc) == "released" and len(world.events) == events


async def test_a_host_that_knows_an_allocation_id_can_neither_answer_its_task_nor_take_its_message_id(
    world: World,
) -> None:
    alloc = await world.request()  # accepted, placement not applied yet: the early-result path is open
    asks_before = len(world.sent("allocation.accepted"))
    # All another host can build from the allocation id is the id's public part.
    guessed = f"prov-{alloc}"
    forged = _result(alloc, guessed).model_copy(update={"node_id": "n2"})
    with pytest.raises(PermanentError) as err:
        await world.send(world.allocator.on_task_result, "node.task_result", forged)
    assert err.value.reason_code == "unknown_task"
    assert world.repo.early == {} and len(world.sent("allocation.accepted")) == asks_before  # no re-ask either

    # The host the task goes to learns its id from the task, and its answer is the one that counts.
    await world.place(alloc)
    (task,) = world.sent("slice.vm_provision")
    assert task["task_id"] == _prov(alloc) != guessed
    await world.send(world.allocator.on_task_result, "node.task_result", _result(alloc, task["task_id"]))
    assert world.state(alloc) == "active"
    # The agent names its answer's Nats-Msg-Id after the task id: another secret, another id, so the id the
    # answer will carry cannot be taken first by a host that was not sent the task.
    other = provision_task_id(AllocatorSettings(enrolment_secret="another-enrolment-secret"), alloc)
    assert other != task["task_id"]
    assert derived_event_id(task["task_id"], "result") != derived_event_id(guessed, "result")


async def _released_baremetal(world: World, wipe_policy: str | None) -> tuple[uuid.UUID, dict[str, Any]]:
    alloc = await _deployed_baremetal(world, wipe_policy)
    await world.send(world.allocator.on_enrolled, "node.enrolled", _enrolled(alloc, SECRET, "abc123"))
    await world.send(
        world.allocator.on_release_requested,
        "allocation.release_requested",
        m.AllocationReleaseRequested(allocation_id=alloc),
    )
    return alloc, world.sent("maas.release_requested")[-1]


async def _machine_released(world: World, alloc: uuid.UUID, release: dict[str, Any], **outcome: Any) -> None:
    """MAAS's answer to the allocation's release command, on `abc123` (bm `n1`), with `outcome`'s fields."""
    await world.send(
        world.allocator.on_maas_result,
        "maas.release_result",
        m.MaasReleaseResult(
            operation_id=release["operation_id"],
            allocation_id=alloc,
            system_id="abc123",
            node_id="n1",
            attempts=1,
            **outcome,
        ),
    )


@pytest.mark.parametrize(
    "wipe_policy, erase_mode",
    [("nvme_format", "secure"), ("crypto_erase", "secure"), ("blkdiscard", "secure"), (None, "secure")],
)
async def test_the_machine_release_asks_the_erase_of_the_sites_wipe_policy_kept_from_placement(
    world: World, wipe_policy: str | None, erase_mode: str
) -> None:
    alloc, release = await _released_baremetal(world, wipe_policy)
    assert release["erase_mode"] == erase_mode
    await _machine_released(
        world,
        alloc,
        release,
        status="released",
        resolution="direct",
        maas_status_name="Ready",
        erase_mode=erase_mode,
        erase_outcome="erased",
    )
    released = world.sent("allocation.released")[-1]
    assert released["machine_erase"] == {
        "operation_id": release["operation_id"],
        "mode": erase_mode,
        "outcome": "erased",
        "maas_status_name": "Ready",
    }


async def test_a_failed_erase_fails_the_allocation_with_cleanup_required_and_keeps_the_erase(world: World) -> None:
    alloc, release = await _released_baremetal(world, "crypto_erase")
    await _machine_released(
        world,
        alloc,
        release,
        status="failed",
        resolution="polled",
        maas_status_name="Failed disk erasing",
        status_message="Failed to erase disks",
        reason_code="disk_erase_failed",
        erase_mode="secure",
        erase_outcome="failed",
    )
    failed = world.sent("allocation.failed")[-1]
    # cleanup_required on a node held whole: the scheduler drains the node, so it is not placed again as if clean.
    assert (failed["reason_code"], failed["cleanup_required"]) == ("disk_erase_failed", True)
    assert (failed["machine_erase"]["mode"], failed["machine_erase"]["outcome"]) == ("secure", "failed")
    assert not world.sent("allocation.released")
