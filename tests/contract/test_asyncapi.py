"""The committed AsyncAPI document is the contract: it equals what the models render, the official
parser accepts it, it names every message type, and it accepts good messages and refuses broken ones."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuaas_common.contract import ALL, BY_TYPE, Envelope
from gpuaas_common.contract.asyncapi import CONTRACT_PATH, ContractValidator, ContractViolation, render_yaml

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "contracts" / "asyncapi.yaml"

ALLOC = str(uuid.UUID("6f1c1a52-5d1e-4a8e-9a57-0c0f5d1b2a11"))
DIGEST = "a" * 64
SLOT = {
    "slot_id": "slice-01-s0",
    "gpu_pci_address": "0000:18:00.0",
    "nvme_by_id": "/dev/disk/by-id/nvme-eui.0123456789abcdef0123456789abcdef",
    "fabric_vf_pci_address": "0000:29:00.1",
    "mac": "52:54:00:00:01:00",
    "private_ip": "127.100.1.10",
    "ovs_bridge": "ovsbr0",
    "numa_node": 0,
    "profile": "h200_1g_24c_64g",
}
IMAGE = {
    "slug": "ubuntu-24.04-h200-slice",
    "digest_sha256": DIGEST,
    "image_path": "/var/lib/gpuaas/slice-images/ubuntu-24.04-h200-slice.raw",
}
EVENT = {"allocation_id": ALLOC, "tenant_id": "tenant-a", "shape": "gpu_slice", "seq": 2}
WIPE = {"device": SLOT["nvme_by_id"], "method": "blkdiscard+zero-verify", "verified": True}
TASK = {
    "task_id": "task-1",
    "allocation_id": ALLOC,
    "node_id": "slice-01",
    "fencing_epoch": 1,
    "deadline": "2030-01-01T00:00:00+00:00",
    "vm_name": "vm-6f1c1a52",
    "slots": [SLOT],
}
MAAS_RESULT = {
    "operation_id": "op-1",
    "allocation_id": ALLOC,
    "system_id": "n0p09j",
    "node_id": "bm-01",
    "resolution": "polled",
    "attempts": 1,
}

# One valid payload per message type; a new type without a sample fails test_every_type_has_a_sample.
SAMPLES: dict[str, dict[str, Any]] = {
    "allocation.requested": {
        "allocation_id": ALLOC,
        "tenant_id": "tenant-a",
        "shape": "gpu_slice",
        "sku": "h200-sxm-slice",
        "gpu_count": 2,
        "image": "ubuntu-24.04-h200-slice",
    },
    "allocation.release_requested": {"allocation_id": ALLOC, "reason": "done"},
    "allocation.rejected": {"allocation_id": ALLOC, "reason_code": "invalid_gpu_count", "reason": "3 is not allowed"},
    "allocation.release_rejected": {
        "allocation_id": ALLOC,
        "tenant_id": "tenant-a",
        "shape": "gpu_slice",
        "state": "released",
        "reason_code": "already_released",
        "reason": "the allocation is already released",
    },
    "allocation.query": {"tenant_id": "tenant-a", "state": "active", "node_id": "slice-01", "limit": 20},
    "allocation.query_result": {
        "status": "found",
        "allocations": [
            {
                "allocation_id": ALLOC,
                "tenant_id": "tenant-a",
                "shape": "gpu_slice",
                "sku": "h200-sxm-slice",
                "gpu_count": 2,
                "region": "default",
                "image": "ubuntu-24.04-h200-slice",
                "state": "active",
                "node_id": "slice-01",
                "access": {"ip": "127.100.1.10", "ssh_ready": True},
                "created_at": "2030-01-01T00:00:00+00:00",
                "updated_at": "2030-01-01T00:01:00+00:00",
            }
        ],
        "timeline": [{"seq": 1, "state": "requested", "at": "2030-01-01T00:00:00+00:00"}],
    },
    "allocation.accepted": {
        **EVENT,
        "state": "accepted",
        "sku": "h200-sxm-slice",
        "gpu_count": 2,
        "region": "default",
        "image": IMAGE,
    },
    "allocation.placed": {**EVENT, "state": "placed", "node_id": "slice-01", "claim_mode": "slots", "slots": [SLOT]},
    "allocation.unschedulable": {
        **EVENT,
        "state": "unschedulable",
        "reason_code": "no_topology_safe_group",
        "reason": "12 GPUs free in region but no node has 4 topology-safe slots",
        "filtered": {"topology": 3},
        "free_gpus": 12,
        "requested_gpus": 4,
    },
    "allocation.provisioning": {**EVENT, "state": "provisioning", "node_id": "slice-01", "task_id": "task-1"},
    "allocation.active": {
        **EVENT,
        "state": "active",
        "node_id": "slice-01",
        "access": {"ip": "127.100.1.10", "mac": "52:54:00:00:01:00", "ssh_ready": True},
    },
    "allocation.releasing": {**EVENT, "state": "releasing", "reason": "tenant asked"},
    "allocation.released": {
        **EVENT,
        "state": "released",
        "node_id": "slice-01",
        "cleanup": {"required": True, "verified": True, "wipe_proofs": [WIPE]},
    },
    "allocation.failed": {
        **EVENT,
        "state": "failed",
        "reason_code": "readiness_timeout",
        "reason": "no lease",
        "node_id": "slice-01",
        "cleanup_required": True,
    },
    "placement.placed": {
        "allocation_id": ALLOC,
        "node_id": "slice-01",
        "claim_mode": "slots",
        "fencing_epoch": 1,
        "slots": [SLOT],
    },
    "placement.unschedulable": {
        "allocation_id": ALLOC,
        "reason_code": "no_capacity",
        "reason": "fleet full",
        "free_gpus": 0,
        "requested_gpus": 1,
    },
    "placement.force_released": {
        "allocation_id": ALLOC,
        "node_ids": ["slice-01"],
        "slot_ids": ["slice-01-s0"],
        "actor": "ops",
        "reason": "host unreachable",
        "forced": True,
        "holders": ["slot slice-01-s0 is active: the allocation's VM may still hold its GPU and disk"],
    },
    "slice.vm_provision": {**TASK, "image": IMAGE, "hostname": "vm-6f1c1a52"},
    "slice.vm_release": TASK,
    "node.task_progress": {
        "task_id": "task-1",
        "allocation_id": ALLOC,
        "node_id": "slice-01",
        "task_type": "slice.vm_provision",
        "phase": "preflight",
    },
    "node.task_result": {
        "task_id": "task-1",
        "allocation_id": ALLOC,
        "node_id": "slice-01",
        "task_type": "slice.vm_provision",
        "status": "succeeded",
        "readiness": {
            "mac": "52:54:00:00:01:00",
            "expected_ip": "127.100.1.10",
            "actual_ip": "127.100.1.10",
            "lease_state": "bound",
            "ssh_ready": True,
        },
    },
    "node.enrolled": {"node_id": "slice-01", "kind": "slice_host", "hostname": "slice-01", "agent_version": "0.1.0"},
    "slice.topology_discover": {"task_id": "task-2", "node_id": "slice-01", "deadline": "2030-01-01T00:00:00+00:00"},
    "slice.parity_check": {"task_id": "task-3", "node_id": "slice-01", "deadline": "2030-01-01T00:00:00+00:00"},
    "slice.vfio_apply": {
        "task_id": "vfio-1",
        "node_id": "slice-01",
        "deadline": "2030-01-01T00:00:00+00:00",
        "action": "bind",
        "slots": [
            {"slot_id": "slice-01-s0", "gpu_pci_address": "0000:18:00.0", "fabric_vf_pci_address": "0000:29:00.2"}
        ],
    },
    "slice.slot_wipe": {
        "task_id": "wipe-1",
        "node_id": "slice-01",
        "deadline": "2030-01-01T00:00:00+00:00",
        "slots": [{"slot_id": "slice-01-s0", "nvme_by_id": "/dev/disk/by-id/nvme-eui.01", "wipe_policy": "blkdiscard"}],
    },
    "node.slot_wipe_reported": {
        "task_id": "wipe-1",
        "node_id": "slice-01",
        "outcomes": [
            {
                "slot_id": "slice-01-s0",
                "device": "/dev/disk/by-id/nvme-eui.01",
                "proof": {"device": "/dev/disk/by-id/nvme-eui.01", "method": "blkdiscard", "verified": True},
            },
            {"slot_id": "slice-01-s1", "device": "/dev/disk/by-id/nvme-eui.02", "reason_code": "disk_leased"},
        ],
    },
    "slice.terminal_open": {
        "task_id": "terminal-1",
        "session_id": "7d6f3c1e-3a9a-4e57-9f43-0c2e5d6b8a11",
        "allocation_id": "3f0f6a8e-5a1d-4d2b-8c47-2b9f9c0e1a22",
        "node_id": "slice-01",
        "deadline": "2030-01-01T00:00:00+00:00",
    },
    "node.terminal_output": {
        "session_id": "7d6f3c1e-3a9a-4e57-9f43-0c2e5d6b8a11",
        "node_id": "slice-01",
        "offset": 0,
        "data": "aGVsbG8K",
    },
    "terminal.output_ack": {"session_id": "7d6f3c1e-3a9a-4e57-9f43-0c2e5d6b8a11", "status": "open", "received": 6},
    "node.terminal_input": {"session_id": "7d6f3c1e-3a9a-4e57-9f43-0c2e5d6b8a11", "node_id": "slice-01", "received": 0},
    "terminal.input": {
        "session_id": "7d6f3c1e-3a9a-4e57-9f43-0c2e5d6b8a11",
        "status": "open",
        "offset": 0,
        "data": "bHMK",
    },
    "node.topology_reported": {
        "node_id": "slice-01",
        "discovered_at": "2030-01-01T00:00:00+00:00",
        "gpus": [
            {
                "pci_address": "0000:18:00.0",
                "vendor_id": "10de",
                "device_id": "2335",
                "numa_node": 0,
                "iommu_group": 30,
                "driver": "vfio-pci",
            }
        ],
        "candidate_slots": [
            {
                "index": 0,
                "gpu_pci_address": "0000:18:00.0",
                "nvme_by_id": SLOT["nvme_by_id"],
                "fabric_vf_pci_address": "0000:29:00.1",
                "mac": "52:54:00:00:01:00",
                "private_ip": "10.100.0.10",
                "ovs_bridge": "ovsbr0",
                "ovs_port": "gpuaas-s0",
                "complete": True,
            }
        ],
        "hugepages_1g_total": 512,
        "hugepages_1g_free": 448,
    },
    "node.parity_reported": {
        "node_id": "slice-01",
        "checked_at": "2030-01-01T00:00:00+00:00",
        "failures": 0,
        "warnings": 0,
        "checks": [{"check": "kvm", "status": "PASS", "detail": "/dev/kvm"}],
    },
    "node.drift_reported": {
        "node_id": "slice-01",
        "checked_at": "2030-01-01T00:00:00+00:00",
        "drift": [
            {
                "kind": "device_binding",
                "subject": "0000:18:00.0",
                "detail": "bound to nvidia",
                "slot_ids": ["slice-01-s0"],
                "devices": ["0000:18:00.0"],
            },
            {"kind": "dhcp_reservation_orphaned", "subject": "gpuaas-1", "detail": "released", "swept": True},
        ],
    },
    "maas.deploy_requested": {
        "operation_id": "op-1",
        "allocation_id": ALLOC,
        "site": "default",
        "system_id": "n0p09j",
        "node_id": "bm-01",
        "profile": "h200-baremetal",
    },
    "maas.release_requested": {
        "operation_id": "op-2",
        "allocation_id": ALLOC,
        "site": "default",
        "system_id": "n0p09j",
        "node_id": "bm-01",
        "erase_mode": "secure",
    },
    "maas.deploy_result": {**MAAS_RESULT, "status": "deployed", "maas_status_name": "Deployed"},
    "maas.release_result": {
        **MAAS_RESULT,
        "status": "released",
        "maas_status_name": "Ready",
        "erase_mode": "secure",
        "erase_outcome": "erased",
    },
    "maas.commission_requested": {
        "operation_id": "op-3",
        "site": "default",
        "system_id": "n0p09j",
        "commissioning_scripts": ["gpuaas-fw", "update_firmware"],
        "scripts": [{"name": "gpuaas-fw", "script": "#!/bin/sh\necho fw\n"}],
    },
    "node.slice_preflight_reported": {
        "operation_id": "op-3",
        "site": "default",
        "system_id": "abc123",
        "node_id": "slice-01",
        "result_set_id": 7,
        "script_name": "50-gpuaas-slice-firmware-preflight",
        "script_status": "Failed",
        "exit_status": 1,
        "status": "failed",
        "reasons": ["kvm: kvm=missing (remediation: enable VT-x/VMX in firmware)"],
        "warnings": [],
        "checks": [{"check": "kvm", "status": "FAIL", "detail": "kvm=missing", "remediation": "enable VT-x/VMX"}],
        "nvme": [
            {
                "by_id": "/dev/disk/by-id/nvme-eui.0001",
                "kernel": "nvme0n1",
                "os_disk": False,
                "mounted": False,
                "signatures": [],
                "children": [{"name": "nvme0n1p1", "mountpoint": "/share2", "fstype": "ext4"}],
            }
        ],
        "reported_at": "2026-04-17T10:00:00Z",
    },
    "maas.commission_result": {
        "operation_id": "op-3",
        "site": "default",
        "status": "succeeded",
        "resolution": "polled",
        "attempts": 1,
        "system_id": "n0p09j",
        "maas_status_name": "Ready",
    },
    "maas.tags_sync_requested": {
        "operation_id": "op-4",
        "site": "default",
        "profile": "h200-baremetal",
        "add_system_ids": ["n0p09j"],
    },
    "maas.tags_sync_result": {
        "operation_id": "op-4",
        "site": "default",
        "status": "succeeded",
        "resolution": "direct",
        "attempts": 1,
        "profile": "h200-baremetal",
        "tags": ["gpuaas-profile-bm"],
        "added": 1,
        "removed": 0,
    },
    "maas.image_upload_requested": {
        "operation_id": "op-5",
        "site": "default",
        "name": "custom/gpuaas-h200-host-ubuntu2404",
        "source_path": "images/gpuaas-h200-host-ubuntu2404.tar.gz",
        "sha256": DIGEST,
    },
    "maas.image_upload_result": {
        "operation_id": "op-5",
        "site": "default",
        "status": "succeeded",
        "resolution": "direct",
        "attempts": 3,
        "name": "custom/gpuaas-h200-host-ubuntu2404",
        "boot_resource_id": 11,
        "sha256": DIGEST,
        "size": 1024,
    },
    "maas.profile_image_set_requested": {
        "operation_id": "op-6",
        "site": "default",
        "profile": "h200-baremetal",
        "distro_series": "gpuaas-h200-host-ubuntu2404",
    },
    "maas.profile_image_set_result": {
        "operation_id": "op-6",
        "site": "default",
        "status": "succeeded",
        "resolution": "direct",
        "attempts": 0,
        "profile": "h200-baremetal",
        "distro_series": "gpuaas-h200-host-ubuntu2404",
        "previous_distro_series": "ubuntu/noble",
        "deploy_distro_series": "custom/gpuaas-h200-host-ubuntu2404",
    },
    "image.activated": {
        "slug": "ubuntu-24.04-h200-slice",
        "kind": "slice",
        "sku": "h200-sxm-slice",
        "digest_sha256": DIGEST,
        "image_path": IMAGE["image_path"],
    },
    "image.deactivated": {"slug": "ubuntu-24.04-h200-slice", "reason": "superseded"},
    "image.published": {
        "slug": "ubuntu-24.04-h200-cuda",
        "build_id": "b-1",
        "digest_sha256": "a" * 64,
        "source_uri": "oci://registry.internal:5000/slice-guest-images/ubuntu-24.04-h200-cuda:t1",
        "image_path": "/var/lib/gpuaas/slice-images/ubuntu-24.04-h200-cuda.raw",
    },
    "image.build_progress": {
        "build_id": "b-1",
        "slug": "ubuntu-24.04-h200-cuda",
        "phase": "push",
        "bytes_done": 10,
        "bytes_total": 20,
    },
    "image.node_cache_changed": {
        "node_id": "slice-01",
        "slug": "ubuntu-24.04-h200-cuda",
        "status": "verified",
        "digest_sha256": "a" * 64,
        "schedulable": True,
    },
    "image.cache_prewarm": {
        "task_id": "t-9",
        "node_id": "slice-01",
        "slug": "ubuntu-24.04-h200-cuda",
        "digest_sha256": "a" * 64,
        "image_path": "/var/lib/gpuaas/slice-images/ubuntu-24.04-h200-cuda.raw",
        "artifact_ref": "oci://registry.internal:5000/slice-guest-images/ubuntu-24.04-h200-cuda:t1",
        "blob_digest": "sha256:" + "b" * 64,
        "blob_size": 100,
        "virtual_size": 1000,
        "blob_media_type": "application/vnd.gpuaas.sparse-raw.v1",
        "registry_tls": "plain-http",
    },
    "node.image_cache_reported": {
        "task_id": "t-9",
        "node_id": "slice-01",
        "slug": "ubuntu-24.04-h200-cuda",
        "status": "mismatch",
        "expected_digest": "a" * 64,
        "digest_sha256": "c" * 64,
        "local_path": "/var/lib/gpuaas/slice-images/ubuntu-24.04-h200-cuda.raw",
        "bytes_done": 100,
        "bytes_total": 100,
        "reason": "image digest differs",
    },
    "usage.recorded": {
        "allocation_id": ALLOC,
        "tenant_id": "tenant-a",
        "shape": "gpu_slice",
        "sku": "h200-sxm-slice",
        "gpu_count": 2,
        "region": "default",
        "node_id": "slice-01",
        "started_at": "2026-10-31T22:00:00Z",
        "stopped_at": "2026-11-01T03:00:00Z",
        "seconds": 18000,
        "ended": "failed",
        "end_reason_code": "force_released",
    },
    "scheduler.host_mode_changed": {
        "node_id": "slice-04",
        "from_mode": "drained",
        "to_mode": "retired",
        "actor": "alice@ops",
        "reason": "chassis returned to the vendor",
        "changed_at": "2026-11-26T22:00:00Z",
    },
    "scheduler.slots_changed": {
        "node_id": "slice-04",
        "generation": 7,
        "cause": "release",
        "actor": "scheduler",
        "slots": [
            {
                "slot_id": "slice-04-s0",
                "status": "cleanup_blocked",
                "status_reason": "no blkdiscard proof for the disk",
                "health_state": "failed",
                "health_detail": "no blkdiscard proof for the disk",
                "profile": "h200_1g_24c_64g",
                "gpu_pci_address": "0000:18:00.0",
                "nvme_by_id": "/dev/disk/by-id/nvme-eui.0001",
                "private_ip": "10.100.0.10",
                "updated_at": "2026-11-26T22:00:00Z",
            },
            {
                "slot_id": "slice-04-s1",
                "status": "disabled",
                "health_state": "healthy",
                "profile": "h200_1g_24c_64g",
                "updated_at": "2026-11-26T21:00:00Z",
            },
        ],
    },
    "scheduler.admin_request_recorded": {
        "service": "scheduler",
        "request_id": "req-1",
        "principal": "admin",
        "actor": "alice@ops",
        "method": "POST",
        "path": "/v1/nodes/slice-01/drain",
        "status": 200,
        "idempotency_key": "k-1",
        "reason": "PSU swap",
        "body_sha256": "a" * 64,
    },
    "image.admin_request_recorded": {
        "service": "image-pipeline",
        "request_id": "req-2",
        "principal": "admin",
        "actor": "bob",
        "method": "POST",
        "path": "/v1/images/ubuntu-24.04-h200-slice/activate",
        "status": 409,
        "error_code": "conflict",
        "replayed": False,
        "body_sha256": "b" * 64,
    },
    "dead_letter": {
        "consumer": "allocator-requested",
        "stream": "ALLOCATIONS",
        "subject": "gpuaas.allocation.requested",
        "reason_code": "not_json",
        "reason": "body is not JSON",
        "body_text": "{oops",
    },
}
SUBJECT_PARAMS = {"node_id": "slice-01", "consumer": "allocator-requested"}


def _subject(type_: str) -> str:
    spec = BY_TYPE[type_]
    if spec.address is None:
        return "_INBOX_ops.Xq3c8bE1.1"  # a reply travels on the asker's inbox, as nats-py names it
    return spec.subject(**{k: SUBJECT_PARAMS[k] for k in spec.parameters})


def _wire(type_: str, payload: dict[str, Any]) -> dict[str, Any]:
    env = Envelope.wrap(type_, payload, producer="contract-test", correlation_id=ALLOC)
    return json.loads(env.model_dump_json())


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return yaml.safe_load(COMMITTED.read_text())


@pytest.fixture(scope="module")
def validator() -> ContractValidator:
    return ContractValidator.from_file(COMMITTED)


def test_committed_document_equals_the_rendered_one():
    assert CONTRACT_PATH.resolve() == COMMITTED.resolve()
    assert render_yaml() == COMMITTED.read_text(), (
        "contracts/asyncapi.yaml drifted from libs/gpuaas_common/contract; run `make contract` and commit it"
    )


def test_official_parser_accepts_the_document():
    node = shutil.which("node")
    script = ROOT / "tools" / "asyncapi-check" / "validate.mjs"
    if node is None or not (ROOT / "tools" / "asyncapi-check" / "node_modules" / "@asyncapi" / "parser").exists():
        pytest.fail("node or @asyncapi/parser missing; run `make setup`")
    proc = subprocess.run(
        [node, str(script), str(COMMITTED.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"AsyncAPI parser rejected the document:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["valid"] is True and report["errors"] == []
    assert report["channels"] > 0 and report["operations"] > 0 and report["messages"] > 0


def test_every_message_type_is_a_component_message_and_back(document):
    components = document["components"]["messages"]
    by_name = {msg["name"]: key for key, msg in components.items()}
    for spec in ALL:
        assert spec.type in by_name, f"{spec.type} has no component message"
        key = by_name[spec.type]
        assert key == spec.model.__name__, f"{spec.type}: component {key} != model {spec.model.__name__}"
        schema_name = components[key]["payload"]["$ref"].rsplit("/", 1)[-1]
        assert schema_name in document["components"]["schemas"], f"{spec.type}: payload schema missing"
        channel = document["channels"][spec.channel]
        assert channel["address"] == spec.address
        assert key in channel["messages"], f"{spec.type} is not carried by channel {spec.channel}"
    for key, msg in components.items():
        assert msg["name"] in BY_TYPE, f"component message {key} ({msg['name']}) maps to no model"
        assert BY_TYPE[msg["name"]].model.__name__ == key
    assert len(components) == len(ALL)


def test_every_type_has_a_sample():
    assert set(SAMPLES) == set(BY_TYPE), "add a sample for each new message type (and drop removed ones)"


@pytest.mark.parametrize("type_", sorted(BY_TYPE))
def test_valid_sample_passes_and_broken_ones_fail(type_, validator):
    spec = BY_TYPE[type_]
    payload = SAMPLES[type_]
    spec.model.model_validate(payload)  # the sample is valid for the code, too
    subject = _subject(type_)
    validator.validate(subject, json.dumps(_wire(type_, payload)))

    unknown_field = _wire(type_, {**payload, "unexpected_field": 1})
    with pytest.raises(ContractViolation):
        validator.validate(subject, json.dumps(unknown_field))

    required = [name for name, field in spec.model.model_fields.items() if field.is_required()]
    if required:  # a query may have no required field (no filter: every allocation)
        missing = _wire(type_, {k: v for k, v in payload.items() if k != required[0]})
        with pytest.raises(ContractViolation):
            validator.validate(subject, json.dumps(missing))

    no_envelope_field = _wire(type_, payload)
    del no_envelope_field["event_id"]
    with pytest.raises(ContractViolation):
        validator.validate(subject, json.dumps(no_envelope_field))

    wrong_type = copy.deepcopy(_wire(type_, payload))
    wrong_type["type"] = "allocation.no_such_type"
    with pytest.raises(ContractViolation):
        validator.validate(subject, json.dumps(wrong_type))


def test_a_reply_travels_only_on_an_inbox_and_a_query_only_on_its_subject(validator):
    reply = json.dumps(_wire("allocation.query_result", SAMPLES["allocation.query_result"]))
    validator.validate("_INBOX.abc.1", reply)
    with pytest.raises(ContractViolation):
        validator.validate("gpuaas.query.allocations", reply)
    query = json.dumps(_wire("allocation.query", SAMPLES["allocation.query"]))
    validator.validate("gpuaas.query.allocations", query)
    with pytest.raises(ContractViolation):
        validator.validate("_INBOX_ops.abc.1", query)


def test_a_message_on_the_wrong_subject_fails(validator):
    body = json.dumps(_wire("allocation.requested", SAMPLES["allocation.requested"]))
    with pytest.raises(ContractViolation):
        validator.validate("gpuaas.allocation.event.active", body)
    with pytest.raises(ContractViolation):
        validator.validate("gpuaas.allocation.requested", b"{not json")
