"""deploy/prometheus and deploy/grafana stay valid and in step with the code: promtool accepts the scrape config
and the rules, every alert fires on its promtool cases, compose's Prometheus scrapes every long-running service,
and the rules and the dashboard read only series the code serves. Their evaluation against a live stack's
/metrics is tests/e2e/test_allocation_flows.py's last test."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuaas_dev import metrics_catalog
from gpuaas_dev.testing import prometheus

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
# The console scripts of compose's long-running services: each one's containers are scraped.
SCRAPED_SCRIPTS = {
    "gpuaas-allocator": "allocator",
    "gpuaas-scheduler": "scheduler",
    "gpuaas-image-pipeline": "image-pipeline",
    "gpuaas-maas-gateway": "maas-gateway",
    "gpuaas-ops-view": "ops-view",
    "gpuaas-sim-fleet": "node-agent",
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed; run `make setup` (Debian's prometheus package ships it)")
    return subprocess.run([binary, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_scrape_config_and_the_rules():
    checked = _promtool("check", "config", "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "alerts.yml" in checked.stdout, "the config loads the rules"
    checked = _promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_fires_on_its_promtool_cases():
    ran = _promtool("test", "rules", "alerts_test.yml")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    cases = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert tested == {rule["alert"] for rule in prometheus.rules()}, "each alert has a case where it fires"


def test_every_rule_pages_with_a_severity_and_a_summary():
    for rule in prometheus.rules():
        assert rule["labels"]["severity"] in ("page", "warning"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["alert"].startswith("Gpuaas"), rule["alert"]


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_runs_prometheus_over_every_long_running_service():
    compose = _compose()
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs: dict[str, set[tuple[str, int]]] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            jobs.setdefault(job["job_name"], set()).update((name, sd["port"]) for name in sd["names"])
    for name, svc in compose["services"].items():
        command = svc.get("command") or []
        if not command or command[0] not in SCRAPED_SCRIPTS:
            continue
        port = int(svc["environment"]["GPUAAS_HEALTH_PORT"])
        assert (name, port) in jobs.get(SCRAPED_SCRIPTS[command[0]], set()), f"{name}:{port} is not scraped"

    prom = compose["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert config["rule_files"] == ["alerts.yml"], "read beside the config, from the same mount"


def test_rules_and_dashboard_read_only_series_the_code_serves():
    known = metrics_catalog.series_names() | {"up"}
    for rule in prometheus.rules():
        names = prometheus.names_in(rule["expr"])
        assert names and names <= known, f"{rule['alert']}: {names - known}"
    dashboard = json.loads(prometheus.DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["templating"]["list"][0]["type"] == "datasource"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        names = prometheus.names_in(expr)
        assert names and names <= known, f"{expr}: {names - known}"
    # Every reading a rule can page on is on the dashboard too.
    on_dashboard = {n for e in exprs for n in prometheus.names_in(e)}
    paged = {n for r in prometheus.rules() for n in prometheus.names_in(r["expr"])} - {"up"}
    assert paged <= on_dashboard, paged - on_dashboard
