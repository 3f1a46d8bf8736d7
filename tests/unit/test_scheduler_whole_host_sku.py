"""A slice-capable host handed out whole serves the baremetal offer: one machine, two SKUs, and its mode
(not its SKU) decides which it serves. Before, a baremetal request could never match a slice host's SKU,
so no host could ever walk from slices to baremetal."""

from __future__ import annotations

from gpuaas_scheduler.domain.placement import NodeCandidate, NodeFacts, Request, node_filter, node_skus

BM = Request("baremetal", 8, "default", "h200-sxm")
SLICE = Request("gpu_slice", 1, "default", "h200-sxm-slice")


def host(mode: str, **kw) -> NodeFacts:
    base = dict(
        node_id="slice-01",
        region="default",
        sku="h200-sxm-slice",
        accepts_slices=True,
        accepts_baremetal=True,
        mode=mode,
        schedulable=True,
        draining=False,
        maintenance=False,
        parity_failures=None,
        live_claims=0,
        exclusive_held=False,
        candidate=NodeCandidate("slice-01", 0, 0, 0, 0, (), 0),
    )
    return NodeFacts(**(base | kw))


def test_a_baremetal_request_may_take_a_slice_sku_host_and_a_slice_request_only_its_own_sku() -> None:
    assert node_skus(BM) == ("h200-sxm", "h200-sxm-slice")
    assert node_skus(SLICE) == ("h200-sxm-slice",)
    assert node_skus(Request("baremetal", 8, "default", "other")) == ("other",)


def test_the_mode_decides_not_the_sku() -> None:
    assert node_filter(host("baremetal"), BM) is None
    for mode in ("slice", "drained", "converting"):
        assert node_filter(host(mode), BM) == "host_mode"
    # A slice request never matches a baremetal-only SKU.
    assert node_filter(host("slice", sku="h200-sxm"), SLICE) == "sku"
