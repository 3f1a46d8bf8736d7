"""What every process's `/metrics` carries beside the counters and histograms its code updates as it works: the
build it runs, and **readings**: gauges a service reads from its own state when it is scraped (counts in its own
tables, the oldest row of its outbox, its own durables' consumer info), so ops page on what is true now without a
background loop keeping copies fresh.

A reading is an async function that returns samples of declared families (`Family`). `READINGS`, one collector per
process, runs every reading at most once per `MIN_INTERVAL_S` however often it is scraped (concurrent scrapes share
one round), each within `TIMEOUT_S`; a reading that fails or times out contributes no samples that round and
`gpuaas_metrics_reading_up{reading}` says 0, so a dead database reads as missing data, never as zeros. Readings
only read: their SQL is the owning service's, over its own schema, and their bus requests are the consumer and
stream info its identity may already ask for (`identity/permissions.py`).

Replicas of one service read the same tables and durables, so dashboards and alert rules take `max by` over a
reading's labels rather than a sum (deploy/prometheus/alerts.yml).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .logging import get_logger

log = get_logger(__name__)

# --- build info -------------------------------------------------------------------------------------------------

BUILD_INFO = Info("gpuaas_build", "The code a process runs: package version and git commit", ["service"])
# The image's `--build-arg REVISION=…` (Dockerfile) reaches the processes as this variable.
REVISION_ENV = "GPUAAS_BUILD_REVISION"
UNKNOWN = "unknown"


def package_version() -> str:
    try:
        return metadata.version("gpuaas")
    except metadata.PackageNotFoundError:
        return UNKNOWN


def git_revision(start: Path | None = None) -> str:
    """The commit this code was built from: `GPUAAS_BUILD_REVISION`, else the HEAD of the git checkout the code
    runs from (an editable install), else `unknown`. Read from the files, without running git."""
    given = os.environ.get(REVISION_ENV, "").strip()
    if given:
        return given[:64]
    here = (start or Path(__file__)).resolve()
    for parent in here.parents:
        dot_git = parent / ".git"
        if dot_git.exists():
            return _head_of(dot_git) or UNKNOWN
    return UNKNOWN


def _head_of(dot_git: Path) -> str | None:
    try:
        if dot_git.is_file():  # a worktree: `gitdir: <path>`
            dot_git = (dot_git.parent / dot_git.read_text().split(":", 1)[1].strip()).resolve()
        head = (dot_git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head[:64] or None
        ref = head.split(":", 1)[1].strip()
        common = dot_git
        if (dot_git / "commondir").exists():
            common = (dot_git / (dot_git / "commondir").read_text().strip()).resolve()
        for base in (dot_git, common):
            if (base / ref).exists():
                return (base / ref).read_text().strip()[:64] or None
        packed = common / "packed-refs"
        if packed.exists():
            for line in packed.read_text().splitlines():
                sha, _, name = line.partition(" ")
                if name == ref:
                    return sha
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    return None


def record_build(service: str) -> None:
    BUILD_INFO.labels(service=service).info({"version": package_version(), "git_sha": git_revision()})


# --- readings ---------------------------------------------------------------------------------------------------

MIN_INTERVAL_S = 1.0
TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Family:
    """A metric family a reading fills: its name (a counter's without `_total`), help text and label names."""

    name: str
    doc: str
    labels: tuple[str, ...] = ()
    counter: bool = False

    def __call__(self, *values: str, value: float) -> Sample:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name} takes {len(self.labels)} label values, got {len(values)}")
        return Sample(self, tuple(str(v) for v in values), float(value))


@dataclass(frozen=True)
class Sample:
    family: Family
    values: tuple[str, ...]
    value: float


Reading = Callable[[], Awaitable[Iterable[Sample]]]


def seconds(value: Any) -> float:
    """A number of seconds from SQL (numeric, float or NULL, which reads as 0)."""
    return 0.0 if value is None else float(value)


INFINITY = math.inf

_READING_UP = Family(
    "gpuaas_metrics_reading_up", "1 when the reading answered at the last scrape, 0 when it failed", ("reading",)
)


class Readings(Collector):
    """The process's readings, run when `/metrics` is scraped (`HealthServer`), served from the last round."""

    def __init__(self) -> None:
        self._readings: dict[str, Reading] = {}
        self._samples: dict[str, list[Sample]] = {}
        self._up: dict[str, bool] = {}
        self._last = -math.inf
        self._round: asyncio.Task[None] | None = None

    def add(self, name: str, reading: Reading) -> None:
        """Run `reading` at every scrape under `name` (one of a kind per process: a second replaces the first)."""
        self._readings[name] = reading
        self._last = -math.inf

    def remove(self, name: str, reading: Reading | None = None) -> None:
        """Stop running `name` (only if it is still `reading`, when given) and forget its samples."""
        if reading is None or self._readings.get(name) is reading:
            self._readings.pop(name, None)
            self._samples.pop(name, None)
            self._up.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._readings)

    async def refresh(self) -> None:
        """One round of every reading, unless one ran within MIN_INTERVAL_S; a scrape during a round waits for
        that round."""
        if self._round is not None and not self._round.done():
            await asyncio.shield(self._round)
            return
        if time.monotonic() - self._last < MIN_INTERVAL_S:
            return
        self._round = asyncio.ensure_future(self._run_round())
        await asyncio.shield(self._round)

    async def _run_round(self) -> None:
        readings = dict(self._readings)
        results = await asyncio.gather(
            *(asyncio.wait_for(_collect(r), TIMEOUT_S) for r in readings.values()), return_exceptions=True
        )
        for name, result in zip(readings, results, strict=True):
            if name not in self._readings:
                continue  # removed while it ran
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                log.warning("metrics_reading_failed", reading=name, error=repr(result)[:300])
                self._samples[name], self._up[name] = [], False
            else:
                self._samples[name], self._up[name] = result, True
        self._last = time.monotonic()

    def collect(self) -> Iterator[Metric]:
        families: dict[str, tuple[Family, list[Sample]]] = {}
        for samples in self._samples.values():
            for s in samples:
                families.setdefault(s.family.name, (s.family, []))[1].append(s)
        up = [_READING_UP(name, value=1.0 if ok else 0.0) for name, ok in sorted(self._up.items())]
        if up:
            families[_READING_UP.name] = (_READING_UP, up)
        for family, samples in families.values():
            metric: GaugeMetricFamily | CounterMetricFamily
            if family.counter:
                metric = CounterMetricFamily(family.name, family.doc, labels=list(family.labels))
            else:
                metric = GaugeMetricFamily(family.name, family.doc, labels=list(family.labels))
            for s in samples:
                metric.add_metric(list(s.values), s.value)
            yield metric

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families come and go with the readings: no fixed names to reserve


async def _collect(reading: Reading) -> list[Sample]:
    return list(await reading())


READINGS = Readings()
REGISTRY.register(READINGS)


# --- readings every service shares ------------------------------------------------------------------------------

OUTBOX_DEPTH = Family("gpuaas_outbox_depth", "Outbox rows not yet published", ("schema",))
OUTBOX_OLDEST = Family(
    "gpuaas_outbox_oldest_age_seconds", "Age of the oldest outbox row not yet published (0 when empty)", ("schema",)
)
CONSUMER_PENDING = Family(
    "gpuaas_consumer_pending_messages",
    "Messages in the stream that match a durable and were not yet delivered to it",
    ("consumer", "stream"),
)
CONSUMER_ACK_PENDING = Family(
    "gpuaas_consumer_ack_pending_messages",
    "Messages delivered to a durable and not yet acknowledged",
    ("consumer", "stream"),
)
CONSUMER_REDELIVERED = Family(
    "gpuaas_consumer_redelivered_messages",
    "Unacknowledged messages a durable has been sent more than once",
    ("consumer", "stream"),
)


def outbox_reading(pool: Any, schema: str) -> Reading:
    """Depth and oldest age of the service's own outbox (a table the relay keeps near empty)."""

    async def read() -> list[Sample]:
        row = await pool.fetchrow(
            "SELECT count(*) AS depth, EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)) AS oldest FROM outbox"
        )
        return [OUTBOX_DEPTH(schema, value=row["depth"]), OUTBOX_OLDEST(schema, value=seconds(row["oldest"]))]

    return read


def consumer_reading(js: Any, consumers: Callable[[], Iterable[tuple[str, str]]]) -> Reading:
    """Lag and redeliveries of the service's own durables, from JetStream's consumer info (`$JS.API.CONSUMER.INFO`
    of each, which the service's identity may ask). `consumers`: (stream, durable) pairs, read at each scrape."""

    async def one(stream: str, durable: str) -> list[Sample]:
        info = await js.consumer_info(stream, durable, timeout=TIMEOUT_S)
        return [
            CONSUMER_PENDING(durable, stream, value=info.num_pending or 0),
            CONSUMER_ACK_PENDING(durable, stream, value=info.num_ack_pending or 0),
            CONSUMER_REDELIVERED(durable, stream, value=info.num_redelivered or 0),
        ]

    async def read() -> list[Sample]:
        pairs = sorted(set(consumers()))
        found = await asyncio.gather(*(one(stream, durable) for stream, durable in pairs), return_exceptions=True)
        failed = [(pair, r) for pair, r in zip(pairs, found, strict=True) if isinstance(r, BaseException)]
        if failed and len(failed) == len(pairs):
            raise failed[0][1]
        for (stream, durable), exc in failed:  # one durable away (being made again): the others still count
            log.warning("consumer_info_failed", stream=stream, durable=durable, error=repr(exc)[:300])
        return [s for samples in found if not isinstance(samples, BaseException) for s in samples]

    return read
