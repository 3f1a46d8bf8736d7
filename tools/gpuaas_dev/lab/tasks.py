"""Slice tasks for the lab host, shaped as the allocator sends them (contract SliceVmProvision/SliceVmRelease)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from gpuaas_common.contract.catalog import node_task_subject
from gpuaas_common.contract.envelope import Envelope, utcnow

from .lab import LabState

# One emulated vCPU and 1 GiB: what TCG on these machines carries (the profile table's shape rule).
LAB_PROFILE = "h200_1g_1c_1g"


def slot_binding(st: LabState, index: int = 0) -> dict[str, Any]:
    slot = st.slots[index]
    return {
        "slot_id": f"lab-slot-{index}",
        "gpu_pci_address": None,  # the lab has no GPU and says so
        "nvme_by_id": slot.by_id,
        "fabric_vf_pci_address": None,
        "mac": slot.mac,
        "private_ip": slot.private_ip,
        "ovs_bridge": st.bridge,
        "numa_node": None,
        "profile": LAB_PROFILE,
        "wipe_policy": "blkdiscard",
    }


def provision_task(
    st: LabState, node_id: str, image: dict[str, Any], keys: list[str], *, epoch: int = 1
) -> dict[str, Any]:
    alloc = str(uuid.uuid4())
    return {
        "task_id": f"prov-{alloc[:8]}",
        "allocation_id": alloc,
        "node_id": node_id,
        "fencing_epoch": epoch,
        "deadline": (utcnow() + timedelta(minutes=20)).isoformat(),
        "vm_name": f"slice-{alloc[:8]}",
        "slots": [slot_binding(st)],
        "image": {k: image[k] for k in ("slug", "digest_sha256", "image_path")},
        "ssh_public_keys": keys,
        "hostname": f"slice-{alloc[:8]}",
    }


def release_task(prov: dict[str, Any]) -> dict[str, Any]:
    task = {k: prov[k] for k in ("allocation_id", "node_id", "fencing_epoch", "vm_name", "slots", "deadline")}
    return {**task, "task_id": f"rel-{prov['allocation_id'][:8]}"}


async def send(nc: Any, task_type: str, task: dict[str, Any]) -> None:
    """Publish as the allocator does: the contract envelope, its event id as Nats-Msg-Id."""
    env = Envelope.wrap(task_type, task, producer="allocator", correlation_id=task["allocation_id"])
    await nc.jetstream().publish(
        node_task_subject(task_type, task["node_id"]),
        env.model_dump_json().encode(),
        headers={"Nats-Msg-Id": env.event_id},
    )
