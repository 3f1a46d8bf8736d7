"""The allocation as an aggregate: its state machine, the rules that pick the next command, and what each
change leaves behind. Pure: no I/O.

An `Allocation` is loaded (locked) by the repository, asked to do one thing by a handler or a sweep, and saved
in the same unit of work. Each method checks its guards, moves the state through the table in `model.py`,
and records what happened: the column changes (`changes`), the timeline rows (`timeline`) and the messages
to send through the outbox (`events`): lifecycle events, node tasks and MAAS commands. The repository writes
the first two; the service layer hands the third to the outbox.

The process manager's rules, in the order a result meets them:
- a release asked while a command is in flight (placement, provisioning) waits for its answer, whose
  handling starts the teardown; only an allocation at rest is torn down at once;
- a result for a provision task this allocation would be sent, before it is placed, means the commits that
  placed it were lost after the task went out: the result is kept and the placement asked again
  (service_layer/redrive.py); the placement's answer applies it;
- a teardown answered by its own host while the allocation is still active means the commit that started
  the release was lost: the release is taken as asked and its answer applied;
- a task given up on (deadline, forced release) can still be answered: recorded, not applied, except that a
  VM built for nobody is torn down (see `_record_late_answer`);
- a baremetal machine left deployed by a failed allocation is released through MAAS at once (see
  `_release_failed_machine`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel

from gpuaas_common.contract import AllocationState, Envelope, Shape, TaskType, caused_event_id, derived_event_id, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.enrolment import enrolment_proof
from gpuaas_common.logging import get_logger

from .commands import (
    Policy,
    TaskSource,
    deploy_command,
    machine_release_command,
    provision_task,
    release_task,
)
from .erase import erase_mode_for
from .model import ActiveImage, check_transition, release_refusal

log = get_logger(__name__)

LIFECYCLE_MODELS: dict[str, type[m.AllocationEvent]] = {
    AllocationState.ACCEPTED: m.AllocationAccepted,
    AllocationState.PLACED: m.AllocationPlaced,
    AllocationState.UNSCHEDULABLE: m.AllocationUnschedulable,
    AllocationState.PROVISIONING: m.AllocationProvisioning,
    AllocationState.ACTIVE: m.AllocationActive,
    AllocationState.RELEASING: m.AllocationReleasing,
    AllocationState.RELEASED: m.AllocationReleased,
    AllocationState.FAILED: m.AllocationFailed,
}
TERMINAL = (AllocationState.RELEASED, AllocationState.FAILED, AllocationState.UNSCHEDULABLE)
# Not placed yet: waiting for the scheduler's answer, or released before it came.
UNPLACED = (AllocationState.ACCEPTED, AllocationState.RELEASING)

# Timeline reason codes.
FORCE_RELEASED = "force_released"
RELEASE_COMMIT_LOST = "release_commit_lost"
TASK_DEADLINE_PASSED = "task_deadline_passed"
ENROLMENT_TIMEOUT = "enrolment_timeout"
ENROLMENT_REFUSED = "enrolment_refused"
SLICE_ENROLMENT_REFUSED = "slice_enrolment_refused"
# Timeline notes a host's announcements may write onto one allocation (refused enrolments): a tenant's machine can
# announce itself as often as its budget lets it, and each would be a row for good. Past the cap, only logs.
HOST_NOTES_PER_ALLOCATION = 32
PLACEMENT_REASKED = "placement_reasked"
EARLY_TASK_RESULT = "task_result_early"
EARLY_RESULT_MISMATCH = "early_task_result_mismatch"
LATE_TASK_RESULT = "late_task_result_ignored"
LATE_VM_TORN_DOWN = "late_vm_torn_down"
LATE_VM_TEARDOWN_FAILED = "late_vm_teardown_failed"
LATE_VM_TEARDOWN_UNANSWERED = "late_vm_teardown_unanswered"
MACHINE_RELEASED_AFTER_FAILURE = "machine_released_after_failure"
MACHINE_RELEASE_AFTER_FAILURE_FAILED = "machine_release_after_failure_failed"
LATE_DEPLOY_RESULT = "late_deploy_result"
PROVISION_PHASE = "provision_phase"
VM_STOPPED = "vm_stopped"
STOPPED_HARD = "vm_stopped_hard"


# A guard and the action it admits: the first rule whose guard holds handles a node task's result.
ResultRule = tuple[Callable[[m.NodeTaskResult], bool], Callable[[m.NodeTaskResult], None]]


class PlacementNotSeenYet(Exception):
    """Transient: the bus redelivers the message later."""


class ForeignResult(Exception):
    """A result this allocation never asked for: it changes nothing and is dead-lettered."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class TimelineEntry:
    seq: int
    state: str
    previous_state: str | None
    reason_code: str | None
    detail: dict[str, Any] | None
    cause_event_id: str | None


@dataclass(frozen=True)
class Outgoing:
    """A message to send with the unit of work's commit; `subject` fills the subject's parameters."""

    type: str
    payload: BaseModel
    event_id: str
    subject: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class Allocation:
    # Columns of the allocations table.
    allocation_id: uuid.UUID
    tenant_id: str
    shape: str
    state: str
    sku: str = ""
    gpu_count: int = 0
    region: str = ""
    image_slug: str = ""
    image_digest: str = ""
    image_path: str = ""
    image_driver_strategy: str = "preinstalled"
    image_driver_version: str | None = None
    request_hash: str = ""
    request: dict[str, Any] = field(default_factory=dict)
    node_id: str | None = None
    maas_system_id: str | None = None
    placement: dict[str, Any] | None = None
    task_id: str | None = None
    release_task_id: str | None = None
    operation_id: str | None = None
    release_operation_id: str | None = None
    deployed: bool = False
    enrolled: bool = False
    awaiting_result: bool = False
    access: dict[str, Any] | None = None
    failure_code: str | None = None
    failure_reason: str | None = None
    task_deadline_at: datetime | None = None
    timed_out_task_id: str | None = None
    placement_asks: int = 0
    task_reasked_at: datetime | None = None
    # A baremetal walk's moments (placed, deployed, enrolled: ISO times on this allocator's clock; boot_seconds:
    # the host's own count) and where MAAS says the tenant logs in, until `active` turns them into phases/access.
    phase_marks: dict[str, Any] | None = None
    # Timeline notes written from hosts' announcements so far (capped at HOST_NOTES_PER_ALLOCATION).
    host_notes: int = 0
    created_at: datetime | None = None
    updated_at: datetime | None = None
    # Not columns: how the allocation is handled in this unit of work.
    policy: Policy | None = field(default=None, repr=False)
    cause: Envelope | None = field(default=None, repr=False)  # the message being handled; None in a sweep
    last_seq: int = 0  # the timeline's last seq when loaded (the lock holds it)
    is_new: bool = False
    changes: dict[str, Any] = field(default_factory=dict, repr=False)
    timeline: list[TimelineEntry] = field(default_factory=list, repr=False)
    events: list[Outgoing] = field(default_factory=list, repr=False)

    # --- loading and creating ----------------------------------------------------------------------------

    @classmethod
    def from_row(
        cls, row: dict[str, Any], *, last_seq: int, policy: Policy, cause: Envelope | None = None
    ) -> Allocation:
        known = {k: v for k, v in row.items() if k in COLUMNS}
        return cls(**known, last_seq=last_seq, policy=policy, cause=cause)

    @classmethod
    def request_accepted(
        cls,
        req: m.AllocationRequested,
        image: ActiveImage,
        fingerprint: str,
        policy: Policy,
        cause: Envelope | None,
    ) -> Allocation:
        """A new allocation from a validated request: recorded as requested, accepted at once."""
        alloc = cls(req.allocation_id, req.tenant_id, req.shape, "requested", policy=policy, cause=cause, is_new=True)
        alloc._set(
            allocation_id=req.allocation_id,
            tenant_id=req.tenant_id,
            shape=req.shape,
            sku=req.sku,
            gpu_count=req.gpu_count,
            region=req.region,
            image_slug=image.slug,
            image_digest=image.digest_sha256,
            image_path=image.image_path,
            image_driver_strategy=image.driver_strategy,
            image_driver_version=image.driver_version,
            request_hash=fingerprint,
            request=req.model_dump(mode="json"),
            state="requested",
        )
        alloc._record("requested", None, None, None)
        alloc._transition(
            "accepted",
            sku=req.sku,
            gpu_count=req.gpu_count,
            region=req.region,
            image=alloc._image(),
        )
        return alloc

    # --- guards ------------------------------------------------------------------------------------------

    @property
    def awaits_placement(self) -> bool:
        return self.state in UNPLACED and self.node_id is None

    def answers_unplaced_provision(self, res: m.NodeTaskResult) -> bool:
        """The provision task this allocation would be sent, but it is not placed: the commits that placed it
        were lost after the task went out."""
        return (
            self.task_id is None
            and self.state in UNPLACED
            and res.task_id == self._policy.provision_task_id(self.allocation_id)
        )

    def answers_lost_release(self, res: m.NodeTaskResult) -> bool:
        """The teardown of this very allocation, answered by its own host, while the allocation is still active:
        the commit that started the release was lost after its task went out (a database that acknowledged
        commits it then lost; a chaos run found it)."""
        return (
            self.state == "active"
            and self.release_task_id is None
            and res.task_id == self._policy.release_task_id(self.allocation_id)
            and res.node_id == self.node_id
        )

    def gave_up_on(self, res: m.NodeTaskResult) -> bool:
        """A task we did send, but gave up on at its deadline (or abandoned by a forced release)."""
        return bool(self.timed_out_task_id == res.task_id)

    def awaits_provision_answer(self, res: m.NodeTaskResult) -> bool:
        return res.task_id == self.task_id and self.awaiting_result and self.release_task_id is None

    def awaits_release_answer(self, res: m.NodeTaskResult) -> bool:
        return res.task_id == self.release_task_id and self.state == "releasing"

    def awaits_late_vm_teardown(self, res: m.NodeTaskResult) -> bool:
        return res.task_id == self.release_task_id and self.state == "failed" and self.awaiting_result

    def left_vm_running(self, res: m.NodeTaskResult) -> bool:
        """Whether this late answer says a VM now runs that no allocation holds: a slice provision that succeeded
        for an allocation that failed before it heard so, and no teardown sent for it yet."""
        return (
            self.shape == Shape.GPU_SLICE
            and self.state == "failed"
            and res.task_id == self.task_id
            and res.task_type == TaskType.SLICE_VM_PROVISION
            and res.status == "succeeded"
            and self.release_task_id is None
        )

    @property
    def machine_may_be_deployed(self) -> bool:
        """A failed baremetal allocation whose deploy went out and whose machine was not released yet."""
        return (
            self.shape == Shape.BAREMETAL
            and self.operation_id is not None
            and self.release_operation_id is None
            and self.maas_system_id is not None
        )

    def _awaits_deploy_answer(self, res: m.MaasOperationResult) -> bool:
        return isinstance(res, m.MaasDeployResult) and res.operation_id == self.operation_id

    def _awaits_machine_release_answer(self, res: m.MaasOperationResult) -> bool:
        return isinstance(res, m.MaasReleaseResult) and res.operation_id == self.release_operation_id

    def _failed_with_own_operation(self, res: m.MaasOperationResult) -> bool:
        return self.state == "failed" and res.operation_id in {self.operation_id, self.release_operation_id}

    def _is_released(self, res: m.MaasOperationResult) -> bool:
        return self.state == "released"

    # --- portal input -------------------------------------------------------------------------------------

    def release(self, req: m.AllocationReleaseRequested) -> None:
        """Start a release, or answer at once why none can start (so the asker does not wait for nothing)."""
        refusal = release_refusal(self.state)
        if refusal is not None:
            log.info("release_rejected", state=self.state, reason_code=refusal.reason_code)
            self._emit(
                "allocation.release_rejected", release_rejected(req, refusal, self), self._derived("release_rejected")
            )
            return
        at_rest = self.state == "active"
        self._transition("releasing", reason=req.reason)
        # A command already in flight (placement, provisioning) finishes first; its answer starts the teardown.
        if at_rest:
            self._start_teardown()

    # --- placement ----------------------------------------------------------------------------------------

    def place(self, ev: m.PlacementPlaced, early: dict[str, Any] | None = None) -> None:
        """Apply the scheduler's placement; `early`: the kept result of this allocation's provision task, taken
        from the repository (service_layer/redrive.py)."""
        if not self.awaits_placement:
            log.warning("placement_unexpected", state=self.state)
            return
        update = {"node_id": ev.node_id, "maas_system_id": ev.maas_system_id, "placement": ev.model_dump(mode="json")}
        result = self._early_result_from(early, ev.node_id)
        if self.state == "releasing" and result is not None:
            # Released while its record was lost, but the host did build it: tear the VM down like any other.
            self._set(**update, task_id=result.task_id)
            self._start_teardown()
            return
        if self.state == "releasing":
            # Released before anything was built: nothing was touched, the claim can go at once.
            self._set(**update)
            self._transition(
                "released",
                node_id=ev.node_id,
                cleanup=m.CleanupReport(required=False, verified=True, reason="released before provisioning"),
            )
            return
        if self.shape == Shape.BAREMETAL:
            self._mark(placed=utcnow().isoformat())
        self._transition(
            "placed",
            update=update,
            node_id=ev.node_id,
            claim_mode=ev.claim_mode,
            slots=ev.slots,
            maas_system_id=ev.maas_system_id,
        )
        self._start_provisioning()
        if result is not None:
            # The result came before this placement was (again) applied: the task is known now, so apply it.
            log.warning("early_task_result_applied", task_id=result.task_id, status=result.status)
            self._apply_provision_result(result)

    def _early_result_from(self, early: dict[str, Any] | None, node_id: str) -> m.NodeTaskResult | None:
        """The kept result, if it came from the placed node. One from another node describes a VM no claim
        explains any more: recorded, not applied."""
        if early is None:
            return None
        res = m.NodeTaskResult.model_validate(early["result"])
        if early["node_id"] == node_id:
            return res
        log.warning(EARLY_RESULT_MISMATCH, task_id=res.task_id, result_node_id=early["node_id"], placed_node_id=node_id)
        self.note(
            EARLY_RESULT_MISMATCH,
            {"task_id": res.task_id, "result_node_id": early["node_id"], "placed_node_id": node_id},
        )
        return None

    def mark_unschedulable(self, ev: m.PlacementUnschedulable) -> None:
        if self.state not in UNPLACED:
            return
        if self.state == "releasing":
            self._transition("released", cleanup=m.CleanupReport(required=False, verified=True, reason="never placed"))
            return
        self._transition(
            "unschedulable",
            reason_code=ev.reason_code,
            update={"failure_code": ev.reason_code, "failure_reason": ev.reason},
            detail={"filtered": ev.filtered, "free_gpus": ev.free_gpus},
            reason=ev.reason,
            filtered=ev.filtered,
            free_gpus=ev.free_gpus,
            requested_gpus=ev.requested_gpus,
        )

    def force_release(self, ev: m.PlacementForceReleased) -> None:
        """An operator freed the claims in the scheduler: the allocation ends as failed with cleanup required
        (its slots wait in cleanup_blocked). A task still out is given up like one past its deadline, so its
        answer is recorded on the timeline and changes nothing."""
        if self.state in TERMINAL:
            log.info("force_release_noop", state=self.state)
            return
        if self.state == "accepted":
            # The scheduler held claims, so its placement is on the way (the same stream, behind this one only
            # after a redelivery): retried until it has been applied, never failed from a state that forbids it.
            raise PlacementNotSeenYet(f"allocation {ev.allocation_id} force-released before its placement arrived")
        outstanding = (self.release_task_id or self.task_id) if self.awaiting_result else None
        if outstanding is not None:
            self._set(awaiting_result=False, timed_out_task_id=outstanding)
        self.fail(
            FORCE_RELEASED,
            f"force-released by {ev.actor}: {ev.reason}",
            self.node_id,
            detail={"forced": ev.forced, "holders": ev.holders, "slots": ev.slot_ids, "abandoned_task": outstanding},
        )
        self._release_failed_machine()

    def reask_placement(self, accepted_seq: int | None) -> None:
        """Publish the allocation's placement request again (its `allocation.accepted` event, same seq)."""
        asks = (self.placement_asks or 0) + 1
        request = m.AllocationAccepted(
            allocation_id=self.allocation_id,
            tenant_id=self.tenant_id,
            shape=self.shape,
            state="accepted",
            previous_state="requested",
            seq=accepted_seq or 1,
            sku=self.sku,
            gpu_count=self.gpu_count,
            region=self.region,
            image=self._image(),
        )
        self._emit("allocation.accepted", request, derived_event_id(str(self.allocation_id), f"placement-ask:{asks}"))
        # Also restarts the wait: the next ask comes no sooner than another `placement_reask_after_s`.
        self._set(placement_asks=asks)
        log.warning(PLACEMENT_REASKED, allocation_id=str(self.allocation_id), state=self.state, asks=asks)

    def hold_early_result(self, res: m.NodeTaskResult, accepted_seq: int | None) -> None:
        """A result for a provision task the allocation does not know yet, just kept by the repository: noted,
        and the placement asked again now."""
        self.note(
            EARLY_TASK_RESULT,
            {"task_id": res.task_id, "node_id": res.node_id, "status": res.status, "reason_code": res.reason_code},
        )
        self.reask_placement(accepted_seq)

    # --- node task results --------------------------------------------------------------------------------

    def take_task_result(self, res: m.NodeTaskResult) -> None:
        if self.answers_lost_release(res):
            log.warning("release_commit_lost", task_id=res.task_id, node_id=res.node_id, status=res.status)
            # The VM is gone, so the allocation cannot stay active: take the release as asked, apply its answer.
            self._transition(
                "releasing",
                reason_code=RELEASE_COMMIT_LOST,
                update={"release_task_id": res.task_id, "awaiting_result": True},
                reason="the host answered a teardown whose start this allocator had lost",
            )
            self._apply_release_result(res)
            return
        self._check_sender(res)
        for applies, act in self._result_rules():
            if applies(res):
                act(res)
                return
        log.info("task_result_ignored", state=self.state)

    def _result_rules(self) -> tuple[ResultRule, ...]:
        """First match wins."""
        return (
            (self.gave_up_on, self._record_late_answer),
            (self.awaits_provision_answer, self._apply_provision_result),
            (self.awaits_release_answer, self._apply_release_result),
            (self.awaits_late_vm_teardown, self._record_late_vm_teardown),
        )

    def _check_sender(self, res: m.NodeTaskResult) -> None:
        # A host can only report as itself (the bus enforces the subject), but it can still claim a task it was
        # never sent or another host's allocation: both change nothing and are dead-lettered.
        if res.task_id not in {self.task_id, self.release_task_id} - {None}:
            raise ForeignResult("unknown_task", f"no task {res.task_id} was sent for allocation {res.allocation_id}")
        if self.node_id is not None and res.node_id != self.node_id:
            raise ForeignResult(
                "node_mismatch", f"task {res.task_id} went to {self.node_id}, result came from {res.node_id}"
            )

    def _apply_provision_result(self, res: m.NodeTaskResult) -> None:
        if res.status == "succeeded" and self.state != "releasing":
            self._record_phases(res)
            access = _access_of(res.readiness)
            # The common case in one statement: no longer awaiting a result, and active.
            self._transition(
                "active",
                update={"awaiting_result": False, "access": access.model_dump(mode="json")},
                node_id=res.node_id,
                access=access,
                detail={"readiness": res.readiness.model_dump(mode="json") if res.readiness else None},
            )
            return
        self._set(awaiting_result=False)
        if res.status == "succeeded":  # built while a release waited: tear it down now
            self._start_teardown()
            return
        self.fail(
            res.reason_code or "provisioning_failed",
            res.reason,
            res.node_id,
            cleanup_required=res.disk_touched,
            wipe_proofs=list(res.wipe_proofs),
        )

    def _record_phases(self, res: m.NodeTaskResult) -> None:
        """The host's provisioning phases, each with its seconds, on the timeline before `active`: ops read where
        the time went (clone, seed, define, boot, lease, cloud-init, SSH) without the host's logs."""
        for phase, seconds in (res.readiness.phase_seconds if res.readiness else {}).items():
            self._record(self.state, self.state, PROVISION_PHASE, {"phase": phase, "seconds": round(seconds, 3)})

    def _apply_release_result(self, res: m.NodeTaskResult) -> None:
        if res.stop_path is not None:
            # A guest that ignored ACPI was stopped hard: the timeline says so, in its own reason code.
            code = STOPPED_HARD if res.stop_path == "forced" else VM_STOPPED
            self._record(self.state, self.state, code, {"stop_path": res.stop_path, "task_id": res.task_id})
        if res.status == "succeeded":
            # `verified` summarises the host's own account for the portal; the scheduler judges each disk's proof.
            verified = bool(res.wipe_proofs) and all(p.verified for p in res.wipe_proofs)
            cleanup = m.CleanupReport(
                required=True,
                verified=verified,
                wipe_proofs=res.wipe_proofs,
                reason=None if verified else "wipe not verified",
            )
            self._transition("released", update={"awaiting_result": False}, node_id=res.node_id, cleanup=cleanup)
            return
        self._set(awaiting_result=False)
        self.fail(res.reason_code or "release_failed", res.reason, res.node_id, wipe_proofs=list(res.wipe_proofs))

    # A provision task given up on at its deadline (or abandoned by a forced release) can still succeed on the
    # host: its answer was late, not lost. The allocation stays failed -- its slots wait for cleanup, or were
    # freed by ops -- but the VM runs for nobody, holding the tenant's disk and the slot's GPU. It gets the
    # ordinary teardown (`slice.vm_release`, same id and wipe as a release), on the same deadline and one re-ask
    # as any task; the answer is recorded on the failed allocation's timeline for ops (the wipe proof included)
    # and changes no state: the slots' cleanup is ops' repair, which the proof informs.

    def _record_late_answer(self, res: m.NodeTaskResult) -> None:
        """Recorded for ops; applied to nothing; not dead-lettered."""
        log.warning(
            "late_task_result_ignored", task_id=res.task_id, status=res.status, result_reason_code=res.reason_code
        )
        self.note(LATE_TASK_RESULT, _answer(res))
        if self.left_vm_running(res):
            log.warning("late_vm_teardown_started", task_id=res.task_id, node_id=res.node_id)
            self._start_teardown()

    def _record_late_vm_teardown(self, res: m.NodeTaskResult) -> None:
        code = LATE_VM_TORN_DOWN if res.status == "succeeded" else LATE_VM_TEARDOWN_FAILED
        self.note(code, _answer(res), answered=True)
        (log.info if res.status == "succeeded" else log.error)(
            code, task_id=res.task_id, node_id=res.node_id, status=res.status, result_reason_code=res.reason_code
        )

    # --- baremetal: enrolment and MAAS results ------------------------------------------------------------

    def enrol(self, ev: m.NodeEnrolled) -> None:
        """A baremetal host's announcement. Only the allocation's own machine, proving it holds this allocation's
        token, enrols it; anything else changes nothing and is kept on the timeline for ops. The machine's own
        announcement with a wrong proof (user-data that is not what the gateway sent) is not retried by anyone:
        waiting for its deadline would only leave a tenant's machine up for nobody, so it fails now and the
        machine is released."""
        if self.shape != Shape.BAREMETAL or self.node_id != ev.node_id or self.maas_system_id != ev.maas_system_id:
            log.warning("enrolment_unmatched", node_id=ev.node_id, system_id=ev.maas_system_id)
            self._host_note(
                ENROLMENT_REFUSED,
                {"why": "not this allocation's machine", "node_id": ev.node_id, "system_id": ev.maas_system_id},
            )
            return
        expected = enrolment_proof(
            self._policy.enrolment_secret.get_secret_value(), str(ev.allocation_id), self.maas_system_id
        )
        if ev.enrolment_proof != expected:
            log.warning("enrolment_proof_mismatch", node_id=ev.node_id)
            if self.enrolled or self.state != "provisioning":
                self._host_note(ENROLMENT_REFUSED, {"why": "enrolment proof does not match", "node_id": ev.node_id})
                return
            self.fail(
                ENROLMENT_REFUSED,
                f"{ev.node_id} announced itself with a proof that is not this allocation's: its user-data is not "
                "what the gateway sent",
                self.node_id,
            )
            self._release_failed_machine()
            return
        if self.enrolled:
            return  # a repeated announcement
        self._set(enrolled=True)
        self._mark(enrolled=utcnow().isoformat(), boot_seconds=ev.boot_seconds)
        self._maybe_baremetal_active()

    def refuse_slice_enrolment(self, ev: m.NodeEnrolled) -> None:
        """The allocation's machine announced itself as a slice host: a tenant's machine must never offer itself
        for slices (nor join the image gate). Recorded for ops; the message is the caller's to dead-letter."""
        log.warning(SLICE_ENROLMENT_REFUSED, node_id=ev.node_id, state=self.state)
        self._host_note(SLICE_ENROLMENT_REFUSED, {"node_id": ev.node_id, "hostname": ev.hostname})

    def _host_note(self, reason_code: str, detail: dict[str, Any]) -> None:
        """A note a host's message wrote: the first HOST_NOTES_PER_ALLOCATION are kept, the rest only logged."""
        if self.host_notes >= HOST_NOTES_PER_ALLOCATION:
            log.info("host_note_capped", reason_code=reason_code, host_notes=self.host_notes)
            return
        self._set(host_notes=self.host_notes + 1)
        self.note(reason_code, detail)

    def _maybe_baremetal_active(self) -> None:
        if self.state == "provisioning" and self.deployed and self.enrolled:
            marks = self.phase_marks or {}
            ips = marks.get("ip_addresses") or []
            access = m.AccessInfo(
                maas_system_id=self.maas_system_id,
                ip=ips[0] if ips else None,
                user=marks.get("login_user"),
                port=22 if ips else None,
            )
            self._record_baremetal_phases(marks)
            self._transition(
                "active", update={"access": access.model_dump(mode="json")}, node_id=self.node_id, access=access
            )

    def _record_baremetal_phases(self, marks: dict[str, Any]) -> None:
        """The walk's phases on the timeline before `active`, as the host-image runbook asks for baselines:
        allocate (requested to placed), deploy (placed to MAAS Deployed), first_boot (the host's kernel start to
        its agent's announcement, on the host's clock), enrolment (MAAS Deployed to the enrolment recorded; 0 when
        the host announced itself first) and active (requested to active)."""
        now = utcnow()

        def at(key: str) -> datetime | None:
            value = marks.get(key)
            return datetime.fromisoformat(value) if value else None

        placed, deployed, enrolled = at("placed"), at("deployed"), at("enrolled")
        phases: list[tuple[str, float | None]] = [
            ("allocate", _seconds(self.created_at, placed)),
            ("deploy", _seconds(placed, deployed)),
            ("first_boot", marks.get("boot_seconds")),
            ("enrolment", max(0.0, s) if (s := _seconds(deployed, enrolled)) is not None else None),
            ("active", _seconds(self.created_at, now)),
        ]
        for phase, seconds in phases:
            if seconds is not None:
                self._record(self.state, self.state, PROVISION_PHASE, {"phase": phase, "seconds": round(seconds, 3)})

    def _mark(self, **marks: Any) -> None:
        self._set(phase_marks={**(self.phase_marks or {}), **marks})

    def take_maas_result(self, res: m.MaasDeployResult | m.MaasReleaseResult) -> None:
        rules: tuple[tuple[Callable[[Any], bool], Callable[[Any], None]], ...] = (
            (self._is_released, self._stale_maas_result),
            (self._failed_with_own_operation, self._record_after_failure),
            (self._awaits_deploy_answer, self._apply_deploy_result),
            (self._awaits_machine_release_answer, self._apply_machine_release_result),
        )
        for applies, act in rules:
            if applies(res):
                act(res)
                return
        log.info("maas_result_ignored", state=self.state)

    def _stale_maas_result(self, res: m.MaasOperationResult) -> None:
        # A repeat: a release command asked again (its first answer's commit lost, or merely late) is answered
        # again, under a new message id. Stale, acknowledged; before, it was retried until dead-lettered.
        log.info("maas_result_stale", operation_id=res.operation_id, status=res.status, state=self.state)

    def _apply_deploy_result(self, res: m.MaasDeployResult) -> None:
        self._set(awaiting_result=False)
        if res.status == "deployed":
            self._set(deployed=True)
            self._mark(deployed=utcnow().isoformat(), ip_addresses=list(res.ip_addresses), login_user=res.login_user)
            if self.state == "releasing":
                self._start_teardown()
                return
            self._maybe_baremetal_active()
            return
        reason = res.status_message or f"MAAS reports {res.maas_status_name}"
        self.fail(res.reason_code or "deploy_failed", reason, self.node_id)
        # Failed deployment still holds (part of) the tenant's image.
        self._release_failed_machine()

    def _apply_machine_release_result(self, res: m.MaasReleaseResult) -> None:
        self._set(awaiting_result=False)
        erase = _machine_erase(res)
        if res.status == "released" and res.erase_outcome != "erased":
            # Released is not enough: the machine goes back to the pool only with its erase confirmed by MAAS. An
            # older (or a compromised) gateway's `released` without one fails the release, so the node is drained.
            self.fail(
                "disk_erase_unconfirmed",
                f"MAAS released the machine ({res.maas_status_name}) with no confirmed disk erase "
                f"(erase_outcome {res.erase_outcome!r})",
                self.node_id,
                detail={"machine_erase": erase.model_dump(mode="json")},
                machine_erase=erase,
            )
        elif res.status == "released":
            cleanup = m.CleanupReport(required=True, verified=True, reason=f"MAAS {res.maas_status_name}")
            self._transition(
                "released",
                detail={"machine_erase": erase.model_dump(mode="json")},
                node_id=self.node_id,
                cleanup=cleanup,
                machine_erase=erase,
            )
        else:
            # Failed: the scheduler drains the node (cleanup required, a node held whole), so a machine whose disks
            # may still hold the tenant's data is placed again only once ops have seen it and undrained it.
            self.fail(
                res.reason_code or "release_failed",
                res.status_message,
                self.node_id,
                detail={"machine_erase": erase.model_dump(mode="json")},
                machine_erase=erase,
            )

    # A baremetal allocation fails after its deploy was sent when MAAS reports Failed deployment, when the
    # deployed host never enrols, or when ops force-release it. The machine may then run the tenant's image with
    # the tenant's keys -- reachable by a tenant no longer billed for it. The allocation stays failed and the
    # scheduler keeps the node drained for ops, but the machine itself is released through MAAS at once, exactly
    # as a release would (same command: the gateway revokes the host's bus identity first, then MAAS erases per
    # the site profile; MAAS takes a release from Deploying, Deployed or Failed deployment, and one of a machine
    # already Releasing or Ready is a no-op). The gateway answers every operation; the answer is kept on the
    # failed allocation's timeline for ops, who undrain the node once they have seen it.

    def _release_failed_machine(self) -> None:
        """Call after the allocation failed."""
        if not self.machine_may_be_deployed:
            return
        log.warning("failed_machine_release_started", node_id=self.node_id, system_id=self.maas_system_id)
        self._start_teardown()

    def _record_after_failure(self, res: m.MaasDeployResult | m.MaasReleaseResult) -> None:
        """A MAAS answer about a failed allocation's machine: the release sent above, or a deploy answered late."""
        if isinstance(res, m.MaasReleaseResult):
            code = MACHINE_RELEASED_AFTER_FAILURE if res.status == "released" else MACHINE_RELEASE_AFTER_FAILURE_FAILED
        else:
            code = LATE_DEPLOY_RESULT
        detail = {
            "operation_id": res.operation_id,
            "system_id": res.system_id,
            "status": res.status,
            "maas_status_name": res.maas_status_name,
            "reason_code": res.reason_code,
            "status_message": res.status_message,
        }
        if isinstance(res, m.MaasReleaseResult):
            detail["machine_erase"] = _machine_erase(res).model_dump(mode="json")
        self.note(code, detail, answered=True)
        (log.error if code == MACHINE_RELEASE_AFTER_FAILURE_FAILED else log.info)(
            code, operation_id=res.operation_id, system_id=res.system_id, status=res.status
        )
        if isinstance(res, m.MaasDeployResult) and res.status == "deployed":
            # Deployed after all, after the allocation failed (a forced release while MAAS deployed it).
            self._release_failed_machine()

    # --- deadlines (the sweeps in service_layer/deadlines.py) ---------------------------------------------

    def expire_task(self) -> None:
        """The node task is past its deadline plus the grace: asked once more, then given up on."""
        if self.task_reasked_at is None and self.shape == Shape.GPU_SLICE:
            self.reask_task()
            return
        if self.state == "failed":
            # The teardown of a VM built after its allocation failed: nothing left to fail. Asked twice, no
            # answer: the host is gone or its agent is; what runs there is ops' to see (the host's own
            # reconciler reports what it cannot account for once it is back).
            detail = {"task_id": self.release_task_id, "node_id": self.node_id}
            self.note(LATE_VM_TEARDOWN_UNANSWERED, detail, answered=True)
            log.error(LATE_VM_TEARDOWN_UNANSWERED, **detail)
            return
        task_id = self.release_task_id or self.task_id
        deadline = self.task_deadline_at
        self._set(awaiting_result=False, timed_out_task_id=task_id)
        log.warning(
            "task_deadline_passed",
            allocation_id=str(self.allocation_id),
            task_id=task_id,
            node_id=self.node_id,
            deadline=str(deadline),
        )
        self.fail(
            TASK_DEADLINE_PASSED,
            f"node {self.node_id} did not answer task {task_id} by its deadline {deadline}; "
            "the disk may have been touched",
            self.node_id,
            detail={"task_id": task_id, "deadline": deadline.isoformat() if deadline else None},
        )

    def reask_task(self) -> None:
        """Send the overdue task once more under a new message id: an agent that ran it answers from its record
        (its answer, or our commit of it, was lost), one that never saw it refuses it as past its deadline before
        touching the disk, and one still running it answers when done. Only silence after that fails it."""
        task = self._node_task()
        assert self.task_deadline_at is not None and self.node_id is not None
        self._emit(
            _task_type(task),
            task,
            derived_event_id(f"{task.task_id}:{self.task_deadline_at.isoformat()}", "task-reask"),
            node_id=self.node_id,
        )
        self._set(
            task_reasked_at=utcnow(), task_deadline_at=utcnow() + timedelta(seconds=self._policy.task_reask_wait_s)
        )
        log.warning("task_reasked", allocation_id=str(self.allocation_id), task_id=task.task_id, node_id=self.node_id)

    def reask_maas_command(self) -> None:
        """Send the MAAS command waited on again (same operation id), under a new message id each asking."""
        cmd = self._maas_command()
        self._emit(_command_type(cmd), cmd, caused_event_id(cmd.operation_id, "maas-reask", None))
        self._set(awaiting_result=True)  # restarts the wait
        log.warning("maas_command_reasked", allocation_id=str(self.allocation_id), operation_id=cmd.operation_id)

    def expire_enrolment(self, deadline_s: float) -> None:
        """The deployed host never enrolled: nobody can be asked again (only the host enrols), so the node is
        drained for ops (cleanup required: the image is on it) and the machine released through MAAS."""
        log.warning("enrolment_timeout", allocation_id=str(self.allocation_id), node_id=self.node_id)
        reason = f"MAAS deployed {self.maas_system_id} but its host did not enrol within {deadline_s:g} s"
        self.fail(ENROLMENT_TIMEOUT, reason, self.node_id)
        self._release_failed_machine()  # deployed with the tenant's keys, reached by nobody

    # --- commands -----------------------------------------------------------------------------------------

    def _start_provisioning(self) -> None:
        alloc_id = str(self.allocation_id)
        assert self.node_id is not None
        if self.shape == Shape.GPU_SLICE:
            task_id = self._policy.provision_task_id(alloc_id)
            deadline = utcnow() + timedelta(seconds=self._policy.task_deadline_s)
            self._set(task_id=task_id, awaiting_result=True, task_deadline_at=deadline)
            self._emit(
                TaskType.SLICE_VM_PROVISION,
                self._node_task(),
                derived_event_id(alloc_id, "provision-task"),
                node_id=self.node_id,
            )
            self._transition("provisioning", node_id=self.node_id, task_id=task_id)
            return
        assert self.maas_system_id is not None
        operation_id = f"deploy-{alloc_id}"
        self._set(operation_id=operation_id, awaiting_result=True)
        self._emit("maas.deploy_requested", self._maas_command(), derived_event_id(alloc_id, "deploy-command"))
        self._transition("provisioning", node_id=self.node_id, operation_id=operation_id)

    def _start_teardown(self) -> None:
        alloc_id = str(self.allocation_id)
        if self.shape == Shape.GPU_SLICE:
            assert self.node_id is not None
            # A re-ask of the provision task does not use up the teardown's own.
            self._set(
                release_task_id=self._policy.release_task_id(alloc_id),
                awaiting_result=True,
                task_deadline_at=utcnow() + timedelta(seconds=self._policy.task_deadline_s),
                task_reasked_at=None,
            )
            # A release asked again after this commit was lost is a new message the agent answers from its
            # record (caused_event_id), not a duplicate JetStream drops.
            self._emit(
                TaskType.SLICE_VM_RELEASE,
                self._node_task(),
                self._caused(alloc_id, "release-task"),
                node_id=self.node_id,
            )
            return
        self._set(release_operation_id=f"release-{alloc_id}", awaiting_result=True)
        self._emit("maas.release_requested", self._maas_command(), self._caused(alloc_id, "release-command"))

    def _node_task(self) -> m.SliceVmProvision | m.SliceVmRelease:
        """The slice task the allocation waits for, from its record: the teardown once one was sent."""
        assert self.node_id is not None and self.placement is not None and self.task_deadline_at is not None
        src = TaskSource(
            self.allocation_id, self.node_id, self.placement, self.task_deadline_at, self._image(), self.request
        )
        if self.release_task_id:
            return release_task(src, self.release_task_id)
        assert self.task_id is not None
        return provision_task(src, self.task_id)

    def _maas_command(self) -> m.MaasDeployRequested | m.MaasReleaseRequested:
        """The MAAS command the allocation waits on: the machine's release once one was sent."""
        assert self.maas_system_id is not None and self.node_id is not None
        args = (self._policy, self.allocation_id)
        if self.release_operation_id:
            # The placement kept the site's wipe policy (the scheduler's at placement time): the erase follows it.
            erase = erase_mode_for((self.placement or {}).get("wipe_policy"))
            return machine_release_command(*args, self.release_operation_id, self.maas_system_id, self.node_id, erase)
        assert self.operation_id is not None
        keys = list(self.request.get("ssh_public_keys") or [])
        return deploy_command(*args, self.operation_id, self.maas_system_id, self.node_id, keys)

    # --- state changes and what they leave behind ---------------------------------------------------------

    def fail(
        self,
        code: str,
        reason: str | None,
        node_id: str | None,
        *,
        cleanup_required: bool = True,
        wipe_proofs: list[m.WipeProof] | None = None,
        detail: dict[str, Any] | None = None,
        machine_erase: m.MachineErase | None = None,
    ) -> None:
        """The allocation failed; unless told the disk was never touched, it needs cleanup. Wipe proofs the host
        made are passed on for the scheduler, which owns the slots, to judge against the site's policy."""
        self._transition(
            "failed",
            reason_code=code,
            detail=detail,
            update={"failure_code": code, "failure_reason": reason or code},
            reason=reason or code,
            node_id=node_id,
            cleanup_required=cleanup_required,
            wipe_proofs=wipe_proofs or [],
            machine_erase=machine_erase,
        )

    def note(self, reason_code: str, detail: dict[str, Any], *, answered: bool = False) -> None:
        """A timeline entry that changes no state and publishes nothing, for ops: e.g. a host's answer after the
        allocation ended. `answered`: it is the answer the allocation waited for, which it no longer does."""
        if answered:
            self._set(awaiting_result=False)
        self._record(self.state, self.state, reason_code, detail)

    def _transition(
        self,
        new_state: str,
        *,
        reason_code: str | None = None,
        detail: dict[str, Any] | None = None,
        update: dict[str, Any] | None = None,
        **event_fields: Any,
    ) -> None:
        """Move through the table in model.py; a timeline row and a lifecycle event record the move."""
        current = self.state
        check_transition(current, new_state)
        self._set(**(update or {}), state=new_state)
        seq = self._record(new_state, current, reason_code, detail)
        model = LIFECYCLE_MODELS[new_state]
        if reason_code is not None and "reason_code" in model.model_fields:
            event_fields.setdefault("reason_code", reason_code)
        event = model(
            allocation_id=self.allocation_id,
            tenant_id=self.tenant_id,
            shape=self.shape,
            state=new_state,
            previous_state=current,
            seq=seq,
            **event_fields,
        )
        # Redone after a lost commit (caused by another message) it is a new event; see caused_event_id. Under
        # the sequence number alone JetStream dropped it, and the scheduler, which had lost its own commit of the
        # first copy, kept the claims of a released allocation (a chaos run).
        self._emit(f"allocation.{new_state}", event, self._caused(str(self.allocation_id), f"lifecycle:{seq}"))
        log.info(
            "allocation_transition",
            allocation_id=str(self.allocation_id),
            from_state=current,
            to_state=new_state,
            seq=seq,
        )

    def _set(self, **changes: Any) -> None:
        # Recorded even when a value is unchanged: the write also restarts the waits counted from updated_at.
        for name, value in changes.items():
            setattr(self, name, value)
        self.changes.update(changes)

    def _record(
        self, state: str, previous_state: str | None, reason_code: str | None, detail: dict[str, Any] | None
    ) -> int:
        self.last_seq += 1
        cause = self.cause.event_id if self.cause is not None else None
        self.timeline.append(TimelineEntry(self.last_seq, state, previous_state, reason_code, detail, cause))
        return self.last_seq

    def _emit(self, type_: str, payload: BaseModel, event_id: str, **subject: str) -> None:
        self.events.append(Outgoing(type_, payload, event_id, subject))

    def _caused(self, key: str, purpose: str) -> str:
        return str(caused_event_id(key, purpose, self.cause))

    def _derived(self, purpose: str) -> str:
        assert self.cause is not None
        return str(derived_event_id(self.cause.event_id, purpose))

    def _image(self) -> m.ImageRef:
        return m.ImageRef(
            slug=self.image_slug,
            digest_sha256=self.image_digest,
            image_path=self.image_path,
            driver_strategy=self.image_driver_strategy,
            driver_version=self.image_driver_version,
        )

    @property
    def _policy(self) -> Policy:
        assert self.policy is not None, "an allocation is loaded with the allocator's policy"
        return self.policy


COLUMNS = frozenset(
    f.name
    for f in fields(Allocation)
    if f.name not in ("policy", "cause", "last_seq", "is_new", "changes", "timeline", "events")
)


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start is not None and end is not None else None


def release_rejected(
    req: m.AllocationReleaseRequested, refusal: Any, alloc: Allocation | None
) -> m.AllocationReleaseRejected:
    return m.AllocationReleaseRejected(
        allocation_id=req.allocation_id,
        tenant_id=alloc.tenant_id if alloc else None,
        shape=alloc.shape if alloc else None,
        state=alloc.state if alloc else None,
        reason_code=refusal.reason_code,
        reason=refusal.reason,
    )


def _access_of(ready: m.Readiness | None) -> m.AccessInfo:
    return m.AccessInfo(
        ip=ready.actual_ip if ready else None,
        mac=ready.mac if ready else None,
        ssh_ready=ready.ssh_ready if ready else None,
        port=ready.ssh_port if ready else None,
        user=ready.ssh_user if ready else None,
        host_key_fingerprint=ready.host_key_fingerprint if ready else None,
    )


def _answer(res: m.NodeTaskResult) -> dict[str, Any]:
    """A host's task result as kept on the timeline."""
    return {
        "task_id": res.task_id,
        "node_id": res.node_id,
        "status": res.status,
        "reason_code": res.reason_code,
        "reason": res.reason,
        "cleanup_required": res.cleanup_required,
        "wipe_proofs": [p.model_dump(mode="json") for p in res.wipe_proofs],
    }


def _task_type(task: m.SliceVmProvision | m.SliceVmRelease) -> TaskType:
    return TaskType.SLICE_VM_RELEASE if isinstance(task, m.SliceVmRelease) else TaskType.SLICE_VM_PROVISION


def _machine_erase(res: m.MaasReleaseResult) -> m.MachineErase:
    return m.MachineErase(
        operation_id=res.operation_id,
        mode=res.erase_mode,
        outcome=res.erase_outcome,
        maas_status_name=res.maas_status_name,
    )


def _command_type(cmd: m.MaasDeployRequested | m.MaasReleaseRequested) -> str:
    return "maas.release_requested" if isinstance(cmd, m.MaasReleaseRequested) else "maas.deploy_requested"
