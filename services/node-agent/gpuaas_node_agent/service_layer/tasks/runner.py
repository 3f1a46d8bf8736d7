"""Running one task: per-slot locks, replay by task id, the fencing epoch and deadline checks, dispatch to the
task object of its type (provision or release), and the refused/failed bookkeeping that decides
`cleanup_required`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import TaskType, derived_event_id, utcnow
from gpuaas_common.contract import messages as m

from ...adapters import disk
from . import phases
from .context import HostContext, Refused, TaskFailed, TaskLocks, log
from .disks import check_disk, wipe_proof
from .nvlink import NvlinkPartitions
from .provision import ProvisionTask, slot_lease
from .release import ReleaseTask

SLICE_TASKS = (TaskType.SLICE_VM_PROVISION, TaskType.SLICE_VM_RELEASE)


class SliceTask(Protocol):
    async def run(self, task: Any, left_running: dict[str, Any] | None) -> m.NodeTaskResult: ...


class TaskRunner:
    def __init__(
        self,
        ctx: HostContext,
        locks: TaskLocks,
        nvlink: NvlinkPartitions,
        provision: ProvisionTask,
        release: ReleaseTask,
    ) -> None:
        self.ctx = ctx
        self.locks = locks
        self.nvlink = nvlink
        self.provision = provision
        self._tasks: dict[str, SliceTask] = {TaskType.SLICE_VM_PROVISION: provision, TaskType.SLICE_VM_RELEASE: release}

    # --- bus entry ----------------------------------------------------------------------------

    async def on_task(self, ctx: HandlerContext) -> None:
        task = ctx.payload
        if task.node_id != self.ctx.node_id:
            raise PermanentError("schema_invalid", f"task for {task.node_id} delivered to {self.ctx.node_id}")
        slot_ids = [s.slot_id for s in getattr(task, "slots", ())]
        if len(set(slot_ids)) != len(slot_ids):
            # One slot named twice: its lock would be taken twice and the task would wait on itself for good
            # (a forged task did, in the fuzz run). No placement names a slot twice.
            raise PermanentError("schema_invalid", f"task {task.task_id} names a slot more than once: {slot_ids}")
        await self.execute(ctx.envelope.type, task, causation_id=ctx.envelope.event_id)

    async def execute(self, task_type: str, task: Any, *, causation_id: str | None = None) -> m.NodeTaskResult:
        async with contextlib.AsyncExitStack() as stack:
            for slot_id in sorted({s.slot_id for s in task.slots}):
                await stack.enter_async_context(self.locks.slot(slot_id))
            await stack.enter_async_context(self.locks.vm(task.vm_name))
            result = await self.run(task_type, task)
        # The answer to the first message that asked (and to its redeliveries, and to a resume after a restart)
        # has one id, so JetStream keeps one copy. A task asked again by a new message (the control plane lost
        # its commit of the first answer) is answered again under a new id: under the first one JetStream would
        # drop it and the asker would never hear it.
        again = causation_id is not None and self.ctx.store.first_asker(task.task_id, causation_id) != causation_id
        purpose = f"result:{causation_id}" if again else "result"
        await self.ctx.publish(
            "node.task_result",
            result,
            correlation_id=str(task.allocation_id),
            causation_id=causation_id,
            event_id=derived_event_id(task.task_id, purpose),
            node_id=self.ctx.node_id,
        )
        return result

    async def run(self, task_type: str, task: Any) -> m.NodeTaskResult:
        record = self.ctx.store.task(task.task_id)
        if record and record["status"] != "running" and record["result"]:
            log.info(
                "task_replayed", task_id=task.task_id, allocation_id=str(task.allocation_id), status=record["status"]
            )
            return m.NodeTaskResult.model_validate(record["result"])
        # A task a killed agent left running is resumed under the same claim and fencing epoch: every step of
        # provision and release is idempotent (clone again, re-render the seed, redefine, re-check readiness).
        resuming = bool(record and record["status"] == "running")
        touched_before = bool(record and record["disk_touched"])
        self.ctx.store.start_task(
            task.task_id, task_type, str(task.allocation_id), vm_name=task.vm_name, payload=task.model_dump(mode="json")
        )
        try:
            slot_ids = [s.slot_id for s in task.slots]
            # Fencing first: a newer claim on the slot owns its disk, so nothing here may touch it any more.
            stale = self.ctx.store.check_and_record_epochs(slot_ids, task.fencing_epoch)
            if stale and not self._releases_its_own_leases(task_type, task):
                raise Refused("stale_epoch", stale)
            remaining = (task.deadline - utcnow()).total_seconds()
            if remaining <= 0:
                raise Refused("deadline_passed", f"task deadline {task.deadline.isoformat()} has passed")
            deadline = asyncio.timeout(remaining)
            try:
                async with deadline:
                    handler = self._tasks.get(task_type)
                    if handler is None:
                        raise Refused("unsupported_task", task_type)
                    result = await handler.run(task, record if resuming else None)
            except TimeoutError:
                if not deadline.expired():
                    # A timeout of some call inside (NATS, libvirt), not the task's deadline: not this task's
                    # verdict. It propagates, the message is redelivered and the task resumes.
                    raise
                raise TaskFailed(
                    "deadline_exceeded", f"task did not finish by its deadline {task.deadline.isoformat()}"
                ) from None
        except (Refused, TaskFailed) as exc:
            if resuming and touched_before and task_type == TaskType.SLICE_VM_PROVISION and exc.code != "stale_epoch":
                # The interrupted provision cannot go on, and the disk was written: wipe it here, with proof.
                result = await self._wipe_interrupted(task, exc.code, exc.reason)
                self.ctx.store.finish_task(task.task_id, result.status, result.model_dump(mode="json"))
                return result
            result = await self._settle(task, task_type, exc)
        self.ctx.store.finish_task(task.task_id, result.status, result.model_dump(mode="json"))
        return result

    def _releases_its_own_leases(self, task_type: str, task: Any) -> bool:
        """A newer epoch is recorded before a provision is checked against the leases, so a provision refused
        because a live VM holds the slot (the scheduler lost that VM's claim with a Postgres commit and placed
        the slot again) still raised the fence. The VM's own release must not be refused for it: the slot's
        GPUs are still leased to its allocation, so no newer claim ever touched them, and without the release
        the VM would run for nobody (a chaos run found one)."""
        held = [slot_lease(s) for s in task.slots]
        return task_type == TaskType.SLICE_VM_RELEASE and self.ctx.store.holds_leases(str(task.allocation_id), held)

    async def _settle(self, task: Any, task_type: str, exc: Refused | TaskFailed) -> m.NodeTaskResult:
        """The refused or failed result, with the bookkeeping that decides `cleanup_required`."""
        if isinstance(exc, Refused):
            log.warning(
                "task_refused",
                task_id=task.task_id,
                allocation_id=str(task.allocation_id),
                reason_code=exc.code,
                reason=exc.reason,
            )
            if task_type == TaskType.SLICE_VM_PROVISION:
                await self.nvlink.deactivate_quietly(task)
                self.ctx.store.drop_leases(str(task.allocation_id))
            # A release that refused to wipe a disk leaves tenant data on it: the slot still needs cleanup.
            unwiped = task_type == TaskType.SLICE_VM_RELEASE and exc.code.startswith("disk_")
            return phases.result(
                self.ctx, task, task_type, "refused", code=exc.code, reason=exc.reason, cleanup_required=unwiped
            )
        record = self.ctx.store.task(task.task_id)
        touched = bool(record and record["disk_touched"])
        if task_type == TaskType.SLICE_VM_PROVISION:
            # Never leave a half-provisioned VM defined or running: it would hold the GPUs and the disk.
            await self.provision.tear_down(task)
        if not touched:
            self.ctx.store.drop_leases(str(task.allocation_id))
        log.error(
            "task_failed",
            task_id=task.task_id,
            allocation_id=str(task.allocation_id),
            reason_code=exc.code,
            reason=exc.reason,
            cleanup_required=touched,
        )
        return phases.result(
            self.ctx, task, task_type, "failed", code=exc.code, reason=exc.reason, cleanup_required=touched
        )

    async def _wipe_interrupted(self, task: Any, code: str, reason: str) -> m.NodeTaskResult:
        """A provision a restart interrupted after the disk was written, that cannot be resumed: tear the VM down,
        wipe and verify every disk of the task here and report the proofs with `disk_touched`: the slots go back
        to service only if the scheduler finds them to satisfy the site's policy. A wipe that cannot be done or
        verified also says `cleanup_required`, and the leases stay."""
        t = TaskType.SLICE_VM_PROVISION
        await self.provision.tear_down(task)
        (self.ctx.seed_dir / f"{task.vm_name}.iso").unlink(missing_ok=True)
        proofs: list[m.WipeProof] = []
        problem = None
        try:
            paths = [(slot, check_disk(self.ctx.host, slot.nvme_by_id)) for slot in task.slots]
            await phases.enter(self.ctx, task, t, "wipe", disk_touched=True)
            for slot, path in paths:
                # The site's policy came with the slot from placement; an older scheduler sends none.
                proof = await disk.wipe_and_verify(str(path), slot.wipe_policy)
                proofs.append(wipe_proof(slot.nvme_by_id, proof))
        except Refused as exc:
            problem = f"{exc.code}: {exc.reason}"
        except Exception as exc:
            problem = f"wipe_error: {type(exc).__name__}: {exc}"
        unverified = [p for p in proofs if not p.verified]
        if problem is None and unverified:
            problem = "; ".join(f"{p.device}: {p.detail or 'not verified'}" for p in unverified)
        verified = problem is None
        if verified:
            self.ctx.store.drop_leases(str(task.allocation_id))
        log.error(
            "task_interrupted_wiped" if verified else "task_interrupted_wipe_unverified",
            task_id=task.task_id,
            allocation_id=str(task.allocation_id),
            reason_code=code,
            reason=reason,
            wipe_problem=problem,
        )
        detail = f"resume after restart impossible ({code}: {reason}); " + (
            "disk wiped and verified by the agent" if verified else f"wipe not verified: {problem}"
        )
        return phases.result(
            self.ctx, task, t, "failed", code=code, reason=detail[:2000], cleanup_required=not verified, proofs=proofs
        )
