"""The instant simulated slice host answers the image activation gate's prewarm tasks (benchmarks run a fleet
of them: a seeded slice image is active only once every slice host verified it)."""

from __future__ import annotations

from typing import Any

from gpuaas_common.bus_dispatch import HandlerContext
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_dev.sim.instant import InstantSliceHost

DIGEST = "ab" * 32


def _prewarm(task_id: str) -> HandlerContext:
    task = m.ImageCachePrewarm(
        task_id=task_id,
        node_id="slice-01",
        slug="ubuntu-24.04-h200-slice",
        digest_sha256=DIGEST,
        image_path="/var/lib/gpuaas/images/ubuntu-24.04-h200-slice.qcow2",
    )
    env = Envelope.wrap(
        "image.cache_prewarm", task.model_dump(mode="json"), producer="image-pipeline", correlation_id=task_id
    )
    return HandlerContext(
        envelope=env,
        payload=task,
        subject="gpuaas.node.slice-01.task.image.cache_prewarm",
        consumer="node-agent-slice-01",
        num_delivered=1,
    )


async def test_a_prewarm_task_is_answered_verified_at_the_catalog_digest_once_per_task() -> None:
    published: list[tuple[str, Any, dict[str, Any]]] = []

    async def capture(type_: str, payload: Any, **kw: Any) -> None:
        published.append((type_, payload, kw))

    host = InstantSliceHost("slice-01", capture)
    ctx = _prewarm("task-1")
    await host.on_prewarm(ctx)
    await host.on_prewarm(ctx)  # redelivered
    await host.on_prewarm(_prewarm("task-2"))

    (type_, report, kw), again, other = published
    assert type_ == "node.image_cache_reported"
    assert (report.status, report.digest_sha256, report.expected_digest) == ("verified", DIGEST, DIGEST)
    assert (report.node_id, report.slug, report.task_id) == ("slice-01", "ubuntu-24.04-h200-slice", "task-1")
    assert kw["causation_id"] == ctx.envelope.event_id and kw["node_id"] == "slice-01"
    assert again[2]["event_id"] == kw["event_id"] != other[2]["event_id"]
    env = Envelope.wrap(type_, report.model_dump(mode="json"), producer="node-agent", correlation_id="task-1")
    default_validator().validate("gpuaas.node.slice-01.report.image_cache", env.model_dump(mode="json"))
