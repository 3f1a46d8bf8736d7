"""Every metric family the processes export on /metrics, read from the code that defines them: the
prometheus-client metrics the services update as they work, and the readings (`gpuaas_common.metrics.Family`)
they read from their own state when scraped. The README's metrics table is rendered from it (`gpuaas_dev.docs`),
and the e2e metrics test checks every `gpuaas_*` family a live stack serves is listed here."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.metrics import MetricWrapperBase

from gpuaas_common.metrics import Family

# Module -> the processes whose /metrics carry what it defines, in the order the README lists them.
MODULES: tuple[tuple[str, str], ...] = (
    ("gpuaas_common.metrics", "every service"),
    ("gpuaas_common.outbox", "every service with a database"),
    ("gpuaas_common.bus_dispatch", "every service"),
    ("gpuaas_allocator.adapters.metrics", "allocator"),
    ("gpuaas_allocator.service_layer.commands", "allocator"),
    ("gpuaas_scheduler.adapters.metrics", "scheduler"),
    ("gpuaas_image_pipeline.adapters.metrics", "image-pipeline"),
    ("gpuaas_maas_gateway.adapters.metrics", "maas-gateway"),
    ("gpuaas_maas_gateway.service_layer.metrics", "maas-gateway"),
    ("gpuaas_ops_view.adapters.metrics", "ops-view"),
    ("gpuaas_ops_view.entrypoints.follow", "ops-view"),
    ("gpuaas_node_agent.service_layer.tasks.provision", "node-agent"),
)
# Where the common readings apply: a service with a database has an outbox, one with durables their lag.
_COMMON = {
    "gpuaas_outbox_depth": "every service with a database",
    "gpuaas_outbox_oldest_age_seconds": "every service with a database",
}

# What each kind exposes beside its name (prometheus-client also serves `_created` for counters and histograms).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "info": ("_info",),
}


@dataclass(frozen=True)
class MetricDoc:
    name: str  # as exposed: a counter with `_total`, an info with `_info`
    kind: str
    labels: tuple[str, ...]
    doc: str
    services: str
    scraped: bool  # a reading: read from the service's state when /metrics is scraped

    def series_names(self) -> set[str]:
        base = self.name.removesuffix("_total") if self.kind == "counter" else self.name.removesuffix("_info")
        return {base + suffix for suffix in _SUFFIXES[self.kind]}


def catalog() -> list[MetricDoc]:
    found: dict[str, MetricDoc] = {}
    for module_name, services in MODULES:
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            doc: MetricDoc | None = None
            if isinstance(value, Family):
                kind = "counter" if value.counter else "gauge"
                name = f"{value.name}_total" if value.counter else value.name
                doc = MetricDoc(name, kind, value.labels, value.doc, _COMMON.get(value.name, services), True)
            elif isinstance(value, MetricWrapperBase):
                kind = value._type  # noqa: SLF001 - prometheus-client keeps these private
                name = value._name + {"counter": "_total", "info": "_info"}.get(kind, "")  # noqa: SLF001
                doc = MetricDoc(name, kind, tuple(value._labelnames), value._documentation, services, False)  # noqa: SLF001
            if doc is not None and doc.name not in found:
                found[doc.name] = doc
    return list(found.values())


def series_names() -> set[str]:
    """Every series name the catalog's families expose."""
    return {n for doc in catalog() for n in doc.series_names()}


def _rows() -> Iterator[str]:
    yield "| metric | type | labels | served by | what it says |"
    yield "|---|---|---|---|---|"
    for doc in catalog():
        labels = ", ".join(f"`{label}`" for label in doc.labels) or "—"
        kind = f"{doc.kind}, read at scrape" if doc.scraped else doc.kind
        text = doc.doc.replace("|", "\\|").replace("\n", " ")
        yield f"| `{doc.name}` | {kind} | {labels} | {doc.services} | {text} |"


def metrics_section() -> str:
    return "\n".join(_rows())
