"""Readings (gauges read when /metrics is scraped): a round per scrape at most once a second, shared by concurrent
scrapes; a reading that fails or hangs serves nothing and says so; the build's commit comes from the environment
or the checkout's files."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuaas_common import metrics
from gpuaas_common.health import HealthServer
from gpuaas_common.metrics import Family, Readings
from gpuaas_dev.testing.waiting import eventually

DEPTH = Family("test_depth", "A depth", ("queue",))
SEEN = Family("test_seen", "Things seen", counter=True)


def _samples(readings: Readings) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in readings.collect() for s in family.samples}


async def test_a_round_reads_every_reading_and_a_failed_one_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "MIN_INTERVAL_S", 0.0)
    readings = Readings()
    broken = {"now": False}

    async def depth() -> list[metrics.Sample]:
        return [DEPTH("a", value=3), DEPTH("b", value=math.inf), SEEN(value=7)]

    async def flaky() -> list[metrics.Sample]:
        if broken["now"]:
            raise ConnectionError("database away")
        return [DEPTH("c", value=1)]

    readings.add("depth", depth)
    readings.add("flaky", flaky)
    await readings.refresh()
    got = _samples(readings)
    assert got[("test_depth", (("queue", "a"),))] == 3 and got[("test_depth", (("queue", "b"),))] == math.inf
    assert got[("test_seen_total", ())] == 7
    assert got[("gpuaas_metrics_reading_up", (("reading", "flaky"),))] == 1

    broken["now"] = True
    await readings.refresh()
    got = _samples(readings)
    assert ("test_depth", (("queue", "c"),)) not in got, "a failed reading serves nothing, not its old values"
    assert got[("gpuaas_metrics_reading_up", (("reading", "flaky"),))] == 0
    assert got[("gpuaas_metrics_reading_up", (("reading", "depth"),))] == 1

    readings.remove("flaky")
    assert ("gpuaas_metrics_reading_up", (("reading", "flaky"),)) not in _samples(readings)


async def test_a_reading_that_hangs_is_cut_at_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "TIMEOUT_S", 0.05)
    readings = Readings()

    async def hangs() -> list[metrics.Sample]:
        await asyncio.Event().wait()
        return []

    readings.add("hangs", hangs)
    await readings.refresh()
    assert _samples(readings)[("gpuaas_metrics_reading_up", (("reading", "hangs"),))] == 0


async def test_concurrent_scrapes_share_one_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "MIN_INTERVAL_S", 0.0)  # any scrape after a round would start another
    readings = Readings()
    calls = {"n": 0}
    gate = asyncio.Event()

    async def counted() -> list[metrics.Sample]:
        calls["n"] += 1
        await gate.wait()
        return [DEPTH("q", value=calls["n"])]

    async def release() -> None:
        # Scheduled after the five scrapes: each has reached the round by the time it has begun.
        await eventually(lambda: calls["n"] == 1, timeout=5, what="the round begun")
        gate.set()

    readings.add("counted", counted)
    await asyncio.gather(*(readings.refresh() for _ in range(5)), release())
    assert calls["n"] == 1
    await readings.refresh()
    assert calls["n"] == 2, "a scrape after the round reads again (MIN_INTERVAL_S 0 here)"


async def test_a_scrape_within_the_interval_is_served_from_the_last_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "MIN_INTERVAL_S", 3600.0)
    readings = Readings()
    calls = {"n": 0}

    async def counted() -> list[metrics.Sample]:
        calls["n"] += 1
        return [DEPTH("q", value=calls["n"])]

    readings.add("counted", counted)
    await readings.refresh()
    await readings.refresh()
    assert calls["n"] == 1


async def test_the_health_server_serves_the_readings_with_the_build() -> None:
    async def depth() -> list[metrics.Sample]:
        return [DEPTH("health", value=5)]

    metrics.record_build("unit-test")
    metrics.READINGS.add("unit-test-depth", depth)
    server = HealthServer("unit-test")
    port = await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
    finally:
        metrics.READINGS.remove("unit-test-depth", depth)
        await server.stop()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("test_depth", (("queue", "health"),))] == 5
    (build,) = [k for k in samples if k[0] == "gpuaas_build_info" and ("service", "unit-test") in k[1]]
    assert dict(build[1])["version"] and dict(build[1])["git_sha"]


def test_the_commit_comes_from_the_environment_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(metrics.REVISION_ENV, "0123abc")
    assert metrics.git_revision(tmp_path / "x.py") == "0123abc"


def test_the_commit_is_read_from_the_checkouts_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(metrics.REVISION_ENV, raising=False)
    code = tmp_path / "repo" / "libs" / "pkg" / "mod.py"
    code.parent.mkdir(parents=True)
    dot_git = tmp_path / "repo" / ".git"
    (dot_git / "refs" / "heads").mkdir(parents=True)
    (dot_git / "HEAD").write_text("ref: refs/heads/main\n")
    (dot_git / "refs" / "heads" / "main").write_text("a" * 40 + "\n")
    assert metrics.git_revision(code) == "a" * 40
    (dot_git / "refs" / "heads" / "main").unlink()  # packed, as after `git gc`
    (dot_git / "packed-refs").write_text(f"# pack-refs with: peeled\n{'b' * 40} refs/heads/main\n")
    assert metrics.git_revision(code) == "b" * 40
    (dot_git / "HEAD").write_text("c" * 40 + "\n")  # detached
    assert metrics.git_revision(code) == "c" * 40
    assert metrics.git_revision(tmp_path / "elsewhere" / "mod.py") == "unknown", "no checkout above it"
