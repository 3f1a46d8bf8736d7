"""The production node agent runs one real host; the simulated fleet is the dev package's own command."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpuaas_common.startup import StartupFailed
from gpuaas_dev.sim.settings import SimFleetSettings
from gpuaas_node_agent.settings import AgentSettings

ROOT = Path(__file__).resolve().parents[2]
SIMULATION_ONLY = {
    "fleet_file",
    "nats_creds_dir",
    "sim_image_dir",
    "maas_sim_url",
    "maas_sim_ca_file",
    "sim_disk_size_mib",
    "sim_instant_hosts",
}


def test_the_production_agent_has_no_simulation_settings() -> None:
    assert not SIMULATION_ONLY & set(AgentSettings.model_fields)
    assert SIMULATION_ONLY <= set(SimFleetSettings.model_fields)


def test_the_fleet_runner_needs_a_fleet_file(monkeypatch) -> None:
    monkeypatch.delenv("GPUAAS_FLEET_FILE", raising=False)
    with pytest.raises(ValidationError):
        SimFleetSettings()  # type: ignore[call-arg]


def test_the_production_agent_refuses_to_start_without_its_host_id(monkeypatch) -> None:
    from gpuaas_node_agent.entrypoints.main import build_register

    monkeypatch.delenv("GPUAAS_NODE_ID", raising=False)
    with pytest.raises(StartupFailed, match="GPUAAS_NODE_ID") as refused:
        build_register(AgentSettings())
    assert refused.value.reason == "invalid_settings"


def test_console_scripts_point_the_agent_and_the_fleet_at_their_packages() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gpuaas-node-agent"].startswith("gpuaas_node_agent.")
    assert scripts["gpuaas-sim-fleet"].startswith("gpuaas_dev.sim.")
