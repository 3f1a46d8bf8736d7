"""The commands an allocation sends: a VM task to its slice host's node agent, or a deploy/release to the MAAS
gateway. Each is built here only, from the allocation's own record, so a command asked again (its answer
overdue) is the command first sent: same id, same deadline, same slots. Pure: no I/O."""

from __future__ import annotations

import hashlib
import hmac
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from pydantic import SecretStr

from gpuaas_common.contract import messages as m


class HasTaskKey(Protocol):
    @property
    def enrolment_secret(self) -> SecretStr: ...


@dataclass(frozen=True)
class Policy:
    """The settings the allocation's rules read: the allocator's configuration as the domain sees it."""

    enrolment_secret: SecretStr
    task_deadline_s: float
    task_reask_wait_s: float
    maas_site: str
    baremetal_profile: str

    def provision_task_id(self, allocation_id: object) -> str:
        return provision_task_id(self, allocation_id)

    def release_task_id(self, allocation_id: object) -> str:
        return release_task_id(self, allocation_id)


def provision_task_id(keyed: HasTaskKey, allocation_id: object) -> str:
    """One provision task per allocation, named by it: a re-sent task is the same task to the agent."""
    return f"prov-{allocation_id}-{_task_tag(keyed, 'prov', allocation_id)}"


def release_task_id(keyed: HasTaskKey, allocation_id: object) -> str:
    """One teardown task per allocation, named by it, so its answer is recognised even when the commit that
    started the release was lost (Allocation.answers_lost_release)."""
    return f"rel-{allocation_id}-{_task_tag(keyed, 'rel', allocation_id)}"


def _task_tag(keyed: HasTaskKey, kind: str, allocation_id: object) -> str:
    # Keyed with the allocator's secret: only the host a task is sent to learns its id, so no other host can
    # answer it (an early result is recognised by this id alone), nor take its answer's Nats-Msg-Id, which the
    # agent derives from the task id, before it (JetStream drops a repeated id across the whole stream).
    key = keyed.enrolment_secret.get_secret_value().encode()
    return hmac.new(key, f"task-id:{kind}:{allocation_id}".encode(), hashlib.sha256).hexdigest()[:24]


@dataclass(frozen=True)
class TaskSource:
    """What a node task is built from: the allocation's record once it is placed."""

    allocation_id: uuid.UUID
    node_id: str
    placement: dict[str, Any]
    deadline: datetime
    image: m.ImageRef
    request: dict[str, Any]


def vm_name(allocation_id: uuid.UUID) -> str:
    return f"gpuaas-{str(allocation_id)[:8]}"


def provision_task(src: TaskSource, task_id: str) -> m.SliceVmProvision:
    return m.SliceVmProvision(
        task_id=task_id,
        image=src.image,
        ssh_public_keys=src.request.get("ssh_public_keys", []),
        hostname=src.request.get("hostname") or vm_name(src.allocation_id),
        **_task_common(src),
    )


def release_task(src: TaskSource, task_id: str) -> m.SliceVmRelease:
    return m.SliceVmRelease(task_id=task_id, **_task_common(src))


def _task_common(src: TaskSource) -> dict[str, Any]:
    return {
        "allocation_id": src.allocation_id,
        "node_id": src.node_id,
        "fencing_epoch": src.placement["fencing_epoch"],
        "deadline": src.deadline,
        "vm_name": vm_name(src.allocation_id),
        "slots": [m.SlotBinding(**s) for s in src.placement["slots"]],
        # Absent from a placement stored before partitions: the host then activates none.
        "nvlink_partition": src.placement.get("nvlink_partition"),
    }


def deploy_command(
    policy: Policy,
    allocation_id: uuid.UUID,
    operation_id: str,
    system_id: str,
    node_id: str,
    ssh_public_keys: list[str],
) -> m.MaasDeployRequested:
    return m.MaasDeployRequested(
        operation_id=operation_id,
        allocation_id=allocation_id,
        site=policy.maas_site,
        system_id=system_id,
        node_id=node_id,
        profile=policy.baremetal_profile,
        ssh_public_keys=ssh_public_keys,
    )


def machine_release_command(
    policy: Policy,
    allocation_id: uuid.UUID,
    operation_id: str,
    system_id: str,
    node_id: str,
    erase_mode: m.EraseMode,
) -> m.MaasReleaseRequested:
    return m.MaasReleaseRequested(
        operation_id=operation_id,
        allocation_id=allocation_id,
        site=policy.maas_site,
        system_id=system_id,
        node_id=node_id,
        erase_mode=erase_mode,
    )
