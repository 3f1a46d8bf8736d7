"""Allocation rules: SKUs, request validation and the state machine. Pure: no I/O."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from gpuaas_common.contract.messages import AllocationRequested

# SKU -> (shape, allowed GPU counts). Slices are whole GPUs on one host; baremetal is the whole host.
SKUS: dict[str, tuple[str, frozenset[int]]] = {
    "h200-sxm": ("baremetal", frozenset({8})),
    "h200-sxm-slice": ("gpu_slice", frozenset({1, 2, 4, 8})),
}
IMAGE_KIND_FOR_SHAPE = {"gpu_slice": "slice", "baremetal": "host"}

TRANSITIONS: dict[str, frozenset[str]] = {
    "requested": frozenset({"accepted"}),
    "accepted": frozenset({"placed", "unschedulable", "releasing"}),
    "placed": frozenset({"provisioning", "releasing", "failed"}),
    "provisioning": frozenset({"active", "failed", "releasing"}),
    "active": frozenset({"releasing", "failed"}),
    "releasing": frozenset({"released", "failed"}),
    "released": frozenset(),
    "failed": frozenset(),
    "unschedulable": frozenset(),
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


@dataclass(frozen=True)
class Rejection:
    reason_code: str
    reason: str


def validate_request(req: AllocationRequested, image: ActiveImage | None) -> Rejection | None:
    sku = SKUS.get(req.sku)
    if sku is None:
        return Rejection("unknown_sku", f"SKU {req.sku!r} is not offered; known: {', '.join(sorted(SKUS))}")
    shape, counts = sku
    if req.shape != shape:
        return Rejection("shape_sku_mismatch", f"SKU {req.sku} is sold as {shape}, not {req.shape}")
    if req.gpu_count not in counts:
        allowed = ", ".join(map(str, sorted(counts)))
        return Rejection("invalid_gpu_count", f"{req.sku} takes {allowed} GPUs, not {req.gpu_count}")
    if req.shape == "gpu_slice" and not req.ssh_public_keys:
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
