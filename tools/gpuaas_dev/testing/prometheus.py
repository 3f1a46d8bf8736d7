"""A real `prometheus` (Debian's package, installed by `make setup`) scraping a stack on loopback, for tests that
evaluate the repository's alert rules and dashboard against live /metrics: started with a config of the test's own
(the scrape targets, a short interval, `deploy/prometheus/alerts.yml`), asked through its HTTP API, stopped by its
own PID."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .servers import free_port
from .waiting import eventually

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gpuaas-overview.json"
# A series name in a PromQL expression: ours all start with gpuaas_; `up` is Prometheus's own.
SERIES_NAME = re.compile(r"\b(gpuaas_[a-z0-9_]+|up)\b")


def rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def names_in(expr: str) -> set[str]:
    return set(SERIES_NAME.findall(expr))


def scraped_names(text: str) -> set[str]:
    """Every series name a /metrics page serves."""
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


class Prometheus:
    def __init__(self, run_dir: Path, targets: Mapping[str, Sequence[str]], *, interval_s: float = 1.0) -> None:
        """`targets`: job -> host:port of each process whose /metrics it scrapes."""
        self.run_dir = run_dir
        self.targets = targets
        self.interval_s = interval_s
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = run_dir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed; run `make setup` (Debian's prometheus package)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        every = f"{self.interval_s:g}s"
        config = {
            "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": list(addresses)}]}
                for job, addresses in self.targets.items()
            ],
        }
        (self.run_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(  # noqa: S603 - our own binary, arguments we wrote
                [
                    binary,
                    f"--config.file={self.run_dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.run_dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    async def api(self, path: str, **params: str) -> Any:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{self.url}/api/v1/{path}", params=params) as resp:
                body = await resp.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.api("query", query=expr)
        return data["result"]

    async def wait_until_scraped(self, timeout: float = 30.0) -> None:
        """Every target scraped successfully at least once."""

        async def all_up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                active = (await self.api("targets"))["activeTargets"]
            except aiohttp.ClientError:
                return False  # not listening yet
            wanted = sum(len(a) for a in self.targets.values())
            return len(active) == wanted and all(t["health"] == "up" for t in active)

        await eventually(all_up, timeout=timeout, interval=0.2, what="prometheus scraping every target")

    async def firing(self, alertname: str) -> list[dict[str, Any]]:
        alerts = (await self.api("alerts"))["alerts"]
        return [a for a in alerts if a["labels"].get("alertname") == alertname and a["state"] == "firing"]
