"""The commands the allocator sends once an allocation is placed or released: a VM task to the slice host's
node agent, or a deploy/release to the MAAS gateway."""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta
from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import caused_event_id, derived_event_id, utcnow
from gpuaas_common.contract import messages as m

from ..settings import AllocatorSettings
from .lifecycle import transition


def provision_task_id(settings: AllocatorSettings, allocation_id: object) -> str:
    """One provision task per allocation, named by it: a re-sent task is the same task to the agent."""
    return f"prov-{allocation_id}-{_task_tag(settings, 'prov', allocation_id)}"


def release_task_id(settings: AllocatorSettings, allocation_id: object) -> str:
    """One teardown task per allocation, named by it, so its answer is recognised even when the commit that
    started the release was lost (handlers.on_task_result)."""
    return f"rel-{allocation_id}-{_task_tag(settings, 'rel', allocation_id)}"


def _task_tag(settings: AllocatorSettings, kind: str, allocation_id: object) -> str:
    # Keyed with the allocator's secret: only the host a task is sent to learns its id, so no other host can
    # answer it (an early result is recognised by this id alone), nor take its answer's Nats-Msg-Id, which the
    # agent derives from the task id, before it (JetStream drops a repeated id across the whole stream).
    key = settings.enrolment_secret.get_secret_value().encode()
    return hmac.new(key, f"task-id:{kind}:{allocation_id}".encode(), hashlib.sha256).hexdigest()[:24]


async def start_provisioning(
    settings: AllocatorSettings, ctx: HandlerContext, row: dict[str, Any], ev: m.PlacementPlaced
) -> None:
    alloc_id = str(row["allocation_id"])
    request = row["request"]
    if row["shape"] == "gpu_slice":
        task_id = provision_task_id(settings, alloc_id)
        image_row = row
        deadline = utcnow() + timedelta(seconds=settings.task_deadline_s)
        task = m.SliceVmProvision(
            task_id=task_id,
            allocation_id=row["allocation_id"],
            node_id=ev.node_id,
            fencing_epoch=ev.fencing_epoch,
            deadline=deadline,
            vm_name=f"gpuaas-{alloc_id[:8]}",
            slots=ev.slots,
            image=m.ImageRef(
                slug=image_row["image_slug"],
                digest_sha256=image_row["image_digest"],
                image_path=image_row["image_path"],
            ),
            ssh_public_keys=request.get("ssh_public_keys", []),
            hostname=request.get("hostname") or f"gpuaas-{alloc_id[:8]}",
        )
        await ctx.outbox.add(
            "slice.vm_provision",
            task,
            aggregate_id=alloc_id,
            event_id=derived_event_id(alloc_id, "provision-task"),
            node_id=ev.node_id,
        )
        await transition(
            ctx,
            row,
            "provisioning",
            update={"task_id": task_id, "awaiting_result": True, "task_deadline_at": deadline},
            node_id=ev.node_id,
            task_id=task_id,
        )
    else:
        assert ev.maas_system_id is not None
        operation_id = f"deploy-{alloc_id}"
        cmd = m.MaasDeployRequested(
            operation_id=operation_id,
            allocation_id=row["allocation_id"],
            site=settings.maas_site,
            system_id=ev.maas_system_id,
            node_id=ev.node_id,
            profile=settings.baremetal_profile,
        )
        await ctx.outbox.add(
            "maas.deploy_requested",
            cmd,
            aggregate_id=alloc_id,
            event_id=derived_event_id(alloc_id, "deploy-command"),
        )
        await transition(
            ctx,
            row,
            "provisioning",
            update={"operation_id": operation_id, "awaiting_result": True},
            node_id=ev.node_id,
            operation_id=operation_id,
        )


async def start_teardown(settings: AllocatorSettings, ctx: HandlerContext, row: dict[str, Any]) -> None:
    alloc_id = str(row["allocation_id"])
    placement = row["placement"] or {}
    if row["shape"] == "gpu_slice":
        task_id = release_task_id(settings, alloc_id)
        deadline = utcnow() + timedelta(seconds=settings.task_deadline_s)
        task = m.SliceVmRelease(
            task_id=task_id,
            allocation_id=row["allocation_id"],
            node_id=row["node_id"],
            fencing_epoch=placement["fencing_epoch"],
            deadline=deadline,
            vm_name=f"gpuaas-{alloc_id[:8]}",
            slots=[m.SlotBinding(**s) for s in placement["slots"]],
        )
        await ctx.outbox.add(
            "slice.vm_release",
            task,
            aggregate_id=alloc_id,
            # A release asked again after this commit was lost is a new message the agent answers from its
            # record (caused_event_id), not a duplicate JetStream drops.
            event_id=caused_event_id(alloc_id, "release-task", ctx.envelope),
            node_id=row["node_id"],
        )
        # A re-ask of the provision task does not use up the teardown's own.
        await ctx.uow.repos.update(
            row["allocation_id"],
            release_task_id=task_id,
            awaiting_result=True,
            task_deadline_at=deadline,
            task_reasked_at=None,
        )
    else:
        operation_id = f"release-{alloc_id}"
        cmd = m.MaasReleaseRequested(
            operation_id=operation_id,
            allocation_id=row["allocation_id"],
            site=settings.maas_site,
            system_id=row["maas_system_id"],
            node_id=row["node_id"],
        )
        await ctx.outbox.add(
            "maas.release_requested",
            cmd,
            aggregate_id=alloc_id,
            event_id=caused_event_id(alloc_id, "release-command", ctx.envelope),
        )
        await ctx.uow.repos.update(row["allocation_id"], release_operation_id=operation_id, awaiting_result=True)


def task_again(row: dict[str, Any]) -> tuple[str, m.SliceVmProvision | m.SliceVmRelease]:
    """The slice task the allocation is waiting for, as it was sent (same id, same deadline), from the row and
    the stored placement: asked again when its answer is overdue."""
    alloc_id = str(row["allocation_id"])
    placement = row["placement"] or {}
    slots = [m.SlotBinding(**s) for s in placement["slots"]]
    common = {
        "allocation_id": row["allocation_id"],
        "node_id": row["node_id"],
        "fencing_epoch": placement["fencing_epoch"],
        "deadline": row["task_deadline_at"],
        "vm_name": f"gpuaas-{alloc_id[:8]}",
        "slots": slots,
    }
    if row["release_task_id"]:
        return "slice.vm_release", m.SliceVmRelease(task_id=row["release_task_id"], **common)
    request = row["request"]
    return "slice.vm_provision", m.SliceVmProvision(
        task_id=row["task_id"],
        image=m.ImageRef(slug=row["image_slug"], digest_sha256=row["image_digest"], image_path=row["image_path"]),
        ssh_public_keys=request.get("ssh_public_keys", []),
        hostname=request.get("hostname") or f"gpuaas-{alloc_id[:8]}",
        **common,
    )


def maas_command_again(
    settings: AllocatorSettings, row: dict[str, Any]
) -> tuple[str, m.MaasDeployRequested | m.MaasReleaseRequested]:
    """The MAAS command the allocation is waiting on, as it was sent (same operation id)."""
    common = {
        "allocation_id": row["allocation_id"],
        "site": settings.maas_site,
        "system_id": row["maas_system_id"],
        "node_id": row["node_id"],
    }
    if row["release_operation_id"]:
        return "maas.release_requested", m.MaasReleaseRequested(operation_id=row["release_operation_id"], **common)
    return "maas.deploy_requested", m.MaasDeployRequested(
        operation_id=row["operation_id"], profile=settings.baremetal_profile, **common
    )
