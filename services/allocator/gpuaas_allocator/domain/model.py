"""Allocation rules: SKUs, request validation and the state machine. Pure: no I/O."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from gpuaas_common.contract import AllocationState as S
from gpuaas_common.contract import Shape
from gpuaas_common.contract.messages import AllocationRequested

# SKU -> (shape, allowed GPU counts). Slices are whole GPUs on one host; baremetal is the whole host.
SKUS: dict[str, tuple[str, frozenset[int]]] = {
    "h200-sxm": (Shape.BAREMETAL, frozenset({8})),
    "h200-sxm-slice": (Shape.GPU_SLICE, frozenset({1, 2, 4, 8})),
}
IMAGE_KIND_FOR_SHAPE = {Shape.GPU_SLICE: "slice", Shape.BAREMETAL: "host"}

TRANSITIONS: dict[str, frozenset[str]] = {
    S.REQUESTED: frozenset({S.ACCEPTED}),
    S.ACCEPTED: frozenset({S.PLACED, S.UNSCHEDULABLE, S.RELEASING}),
    S.PLACED: frozenset({S.PROVISIONING, S.RELEASING, S.FAILED}),
    S.PROVISIONING: frozenset({S.ACTIVE, S.FAILED, S.RELEASING}),
    S.ACTIVE: frozenset({S.RELEASING, S.FAILED}),
    S.RELEASING: frozenset({S.RELEASED, S.FAILED}),
    S.RELEASED: frozenset(),
    S.FAILED: frozenset(),
    S.UNSCHEDULABLE: frozenset(),
}


class InvalidTransition(Exception):
    pass


def check_transition(current: str, new: str) -> None:
    if new not in TRANSITIONS.get(current, frozenset()):
        raise InvalidTransition(f"{current} -> {new} is not allowed")


@dataclass(frozen=True)
class ActiveImage:
    slug: str
    kind: str
    sku: str
    digest_sha256: str
    image_path: str
    driver_strategy: str = "preinstalled"
    driver_version: str | None = None


@dataclass(frozen=True)
class Rejection:
    reason_code: str
    reason: str


def allowed_gpu_counts(sku: str) -> tuple[int, ...]:
    """The GPU counts a SKU is sold in, ascending; () for an unknown SKU."""
    entry = SKUS.get(sku)
    return tuple(sorted(entry[1])) if entry else ()


def validate_offer(shape: str, sku_name: str, gpu_count: int) -> Rejection | None:
    """Is (shape, SKU, GPU count) something we sell? The part of validation that needs no catalog, so a
    client can refuse a bad request before it publishes anything."""
    sku = SKUS.get(sku_name)
    if sku is None:
        return Rejection("unknown_sku", f"SKU {sku_name!r} is not offered; known: {', '.join(sorted(SKUS))}")
    sold_as, counts = sku
    if shape != sold_as:
        return Rejection("shape_sku_mismatch", f"SKU {sku_name} is sold as {sold_as}, not {shape}")
    if gpu_count not in counts:
        allowed = ", ".join(map(str, sorted(counts)))
        return Rejection("invalid_gpu_count", f"{sku_name} takes {allowed} GPUs, not {gpu_count}")
    return None


def validate_request(req: AllocationRequested, image: ActiveImage | None) -> Rejection | None:
    offer = validate_offer(req.shape, req.sku, req.gpu_count)
    if offer is not None:
        return offer
    if req.shape == Shape.GPU_SLICE and not req.ssh_public_keys:
        return Rejection("ssh_key_required", "a slice VM has no password login: give at least one SSH public key")
    if image is None:
        return Rejection("image_not_active", f"image {req.image!r} is not active")
    if image.kind != IMAGE_KIND_FOR_SHAPE[req.shape]:
        return Rejection("image_incompatible", f"image {req.image} is a {image.kind} image, not for {req.shape}")
    if image.sku != req.sku:
        return Rejection("image_incompatible", f"image {req.image} is built for {image.sku}, not {req.sku}")
    return None


def request_fingerprint(req: AllocationRequested) -> str:
    """Same allocation_id with the same body is a replay; with another body it is a conflict."""
    canonical = json.dumps(req.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def release_refusal(state: str | None) -> Rejection | None:
    """Why a release request cannot start a release, or None when it can. `state` None: no such allocation."""
    if state is None:
        return Rejection("unknown_allocation", "no allocation with this id was ever accepted")
    if state == "releasing":
        return Rejection("already_releasing", "a release is already under way; allocation.released follows")
    if state == "released":
        return Rejection("already_released", "the allocation is already released")
    if "releasing" not in TRANSITIONS.get(state, frozenset()):
        return Rejection("not_releasable", f"the allocation ended {state}: it holds nothing to release")
    return None
