"""The request as placement sees it, its facts decided once before any node is looked at.

`Request` is the one object every step reads: the node rules (rules.py) judge a node against it, the fit
(fit.py) sizes groups by its GPUs, the why-not answer (explain.py) names what it asked. Facts that need a
query (whether the image cache gate applies: `image_gate`) are settled by the service layer before the search
starts and written into it, so no rule re-derives them node by node. The service layer's `SearchContext` adds
what the search itself needs (rank classes, page size, watermark) around it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuaas_common.contract import Shape

# A baremetal request takes the whole host: all eight GPUs of its board.
BAREMETAL_GPUS = 8


@dataclass(frozen=True)
class Request:
    shape: str  # gpu_slice | baremetal
    gpus: int
    region: str
    sku: str
    tenant_id: str = ""
    # (slug, digest) when the image cache gate applies to this request (see `image_gate` below);
    # None: no cache evidence is required.
    image_gate: tuple[str, str] | None = None
    # The NVIDIA driver inside the guest image (the catalog's); None: the image names none, no version gate.
    driver_version: str | None = None


# A slice-capable host handed out whole is a host of the baremetal offer: one machine, two offers (slice
# SKU -> whole-host SKU). Its mode, not its SKU, decides which one it serves at a time (domain/host_mode.py).
WHOLE_HOST_SKU: dict[str, str] = {"h200-sxm-slice": "h200-sxm"}


def node_skus(req: Request) -> tuple[str, ...]:
    """The node SKUs that may serve the request: its own, and for baremetal the slice SKUs of that host."""
    if req.shape != Shape.BAREMETAL:
        return (req.sku,)
    return (req.sku, *sorted(s for s, whole in WHOLE_HOST_SKU.items() if whole == req.sku))


def image_gate(slug: str, digest: str, reported: bool) -> tuple[str, str] | None:
    """(slug, digest) when slice placement must require a verified cache of this image, else None.

    The rule: the gate applies to an image once any `image.node_cache_changed` for its slug has
    reached the scheduler. Images that predate the prewarm pipeline (the dev stack's seed images,
    copied into each host's cache by the fleet) are never reported, so they stay placeable as before.
    For a prewarmed image the rule is safe even before its reports arrive: the image pipeline
    activates an image only once every known slice host verified the catalog digest, so an
    allocation for it cannot be accepted while a host lacks it; the reports then keep placement
    honest afterwards (a host that loses the cache, a mismatch, a new digest, a host added later).

    `reported`: whether any report for the slug has arrived (read by `prelude`, in the request's first query).
    """
    return (slug, digest) if reported else None
