import itertools
import uuid

import pytest

from gpuaas_allocator.domain.model import (
    ActiveImage,
    InvalidTransition,
    allowed_gpu_counts,
    check_transition,
    release_refusal,
    request_fingerprint,
    validate_offer,
    validate_request,
)
from gpuaas_common.contract.messages import AllocationRequested

SLICE_IMAGE = ActiveImage("ubuntu-24.04-h200-slice", "slice", "h200-sxm-slice", "0" * 64, "/images/s.raw")
HOST_IMAGE = ActiveImage("ubuntu-24.04-h200-host", "host", "h200-sxm", "1" * 64, "custom/h")


def req(**kw) -> AllocationRequested:
    base = dict(
        allocation_id=uuid.uuid4(),
        tenant_id="t",
        shape="gpu_slice",
        sku="h200-sxm-slice",
        gpu_count=1,
        image=SLICE_IMAGE.slug,
        ssh_public_keys=["ssh-ed25519 AAAA tenant@x"],
    )
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
    assert (
        validate_request(req(shape="baremetal", sku="h200-sxm", gpu_count=8, image=HOST_IMAGE.slug), HOST_IMAGE) is None
    )


def test_fingerprint_is_stable_and_body_sensitive():
    a = req()
    same = AllocationRequested(**a.model_dump())
    assert request_fingerprint(a) == request_fingerprint(same)
    assert request_fingerprint(a) != request_fingerprint(AllocationRequested(**{**a.model_dump(), "gpu_count": 2}))


LIFECYCLE = ["requested", "accepted", "placed", "provisioning", "active", "releasing", "released"]
AT_REST_OR_IN_FLIGHT = ["accepted", "placed", "provisioning", "active"]
ENDS = ["released", "failed", "unschedulable"]
STATES = sorted(set(LIFECYCLE) | set(ENDS))


def test_the_lifecycle_walks_from_requested_to_released():
    walked = [LIFECYCLE[0]]
    for current, new in itertools.pairwise(LIFECYCLE):
        check_transition(current, new)  # raises InvalidTransition on a refused step
        walked.append(new)
    assert walked == LIFECYCLE


@pytest.mark.parametrize("state", AT_REST_OR_IN_FLIGHT)
def test_a_release_can_start_from_every_live_state(state):
    check_transition(state, "releasing")
    with pytest.raises(InvalidTransition):
        check_transition(state, "released")  # but nothing is free again without going through releasing


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("to", STATES)
def test_an_ended_allocation_never_moves_again(end, to):
    with pytest.raises(InvalidTransition):
        check_transition(end, to)


@pytest.mark.parametrize(
    "current, new",
    [
        ("released", "active"),
        ("failed", "releasing"),
        ("accepted", "active"),
        ("unschedulable", "placed"),
        ("active", "placed"),
    ],
)
def test_forbidden_transitions(current, new):
    with pytest.raises(InvalidTransition):
        check_transition(current, new)


@pytest.mark.parametrize(
    "state, code",
    [
        (None, "unknown_allocation"),
        ("releasing", "already_releasing"),
        ("released", "already_released"),
        ("failed", "not_releasable"),
        ("unschedulable", "not_releasable"),
        *((s, None) for s in AT_REST_OR_IN_FLIGHT),
    ],
)
def test_a_release_is_refused_exactly_where_the_state_machine_has_no_releasing(state, code):
    refusal = release_refusal(state)
    assert (refusal.reason_code if refusal else None) == code


@pytest.mark.parametrize(
    "shape, sku, gpus, code",
    [
        ("gpu_slice", "h200-sxm-slice", 0, "invalid_gpu_count"),
        ("gpu_slice", "h200-sxm-slice", -1, "invalid_gpu_count"),
        ("gpu_slice", "h200-sxm-slice", 3, "invalid_gpu_count"),
        ("gpu_slice", "h200-sxm-slice", 16, "invalid_gpu_count"),
        ("baremetal", "h200-sxm", 4, "invalid_gpu_count"),
        ("baremetal", "h200-sxm-slice", 8, "shape_sku_mismatch"),
        ("gpu_slice", "h100", 1, "unknown_sku"),
        ("gpu_slice", "h200-sxm-slice", 4, None),
        ("baremetal", "h200-sxm", 8, None),
    ],
)
def test_the_offer_check_a_client_runs_before_publishing(shape, sku, gpus, code):
    refusal = validate_offer(shape, sku, gpus)
    assert (refusal.reason_code if refusal else None) == code
    assert allowed_gpu_counts("h200-sxm-slice") == (1, 2, 4, 8) and allowed_gpu_counts("h200-sxm") == (8,)
