import uuid

import pytest

from gpuaas_allocator.domain.model import (
    ActiveImage,
    InvalidTransition,
    check_transition,
    request_fingerprint,
    validate_request,
)
from gpuaas_common.contract.messages import AllocationRequested

SLICE_IMAGE = ActiveImage("ubuntu-24.04-h200-slice", "slice", "h200-sxm-slice", "0" * 64, "/images/s.raw")
HOST_IMAGE = ActiveImage("ubuntu-24.04-h200-host", "host", "h200-sxm", "1" * 64, "custom/h")


def req(**kw) -> AllocationRequested:
    base = dict(allocation_id=uuid.uuid4(), tenant_id="t", shape="gpu_slice", sku="h200-sxm-slice", gpu_count=1,
                image=SLICE_IMAGE.slug, ssh_public_keys=["ssh-ed25519 AAAA tenant@x"])
    base.update(kw)
    return AllocationRequested(**base)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_slice_gpu_counts_allowed(gpus):
    assert validate_request(req(gpu_count=gpus), SLICE_IMAGE) is None


@pytest.mark.parametrize("gpus", [3, 5, 6, 7, 16])
def test_slice_gpu_counts_rejected(gpus):
    assert validate_request(req(gpu_count=gpus), SLICE_IMAGE).reason_code == "invalid_gpu_count"


@pytest.mark.parametrize(
    "overrides, image, code",
    [
        ({"sku": "h100-pcie"}, SLICE_IMAGE, "unknown_sku"),
        ({"shape": "baremetal"}, SLICE_IMAGE, "shape_sku_mismatch"),
        ({}, None, "image_not_active"),
        ({"image": HOST_IMAGE.slug}, HOST_IMAGE, "image_incompatible"),
        ({"shape": "baremetal", "sku": "h200-sxm", "gpu_count": 4}, HOST_IMAGE, "invalid_gpu_count"),
        ({"ssh_public_keys": []}, SLICE_IMAGE, "ssh_key_required"),
    ],
)
def test_rejections_carry_reason_codes(overrides, image, code):
    rejection = validate_request(req(**overrides), image)
    assert rejection is not None and rejection.reason_code == code and rejection.reason


def test_baremetal_takes_the_whole_host():
    assert validate_request(req(shape="baremetal", sku="h200-sxm", gpu_count=8, image=HOST_IMAGE.slug), HOST_IMAGE) is None


def test_fingerprint_is_stable_and_body_sensitive():
    a = req()
    same = AllocationRequested(**a.model_dump())
    assert request_fingerprint(a) == request_fingerprint(same)
    assert request_fingerprint(a) != request_fingerprint(AllocationRequested(**{**a.model_dump(), "gpu_count": 2}))


@pytest.mark.parametrize("current, new", [("accepted", "placed"), ("provisioning", "active"), ("active", "releasing"),
                                          ("releasing", "released"), ("accepted", "releasing")])
def test_allowed_transitions(current, new):
    check_transition(current, new)


@pytest.mark.parametrize("current, new", [("released", "active"), ("failed", "releasing"), ("accepted", "active"),
                                          ("unschedulable", "placed"), ("active", "placed")])
def test_forbidden_transitions(current, new):
    with pytest.raises(InvalidTransition):
        check_transition(current, new)
