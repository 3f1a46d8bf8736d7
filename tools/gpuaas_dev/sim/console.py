"""`gpuaas-sim-fleet`'s command line. Kept apart from fleet.py, whose imports (the agent, libvirt, aiohttp) take
about a second: `--help` and `--version` are answered with only the settings imported."""

from __future__ import annotations

from gpuaas_common.service_args import service_command_line

from .settings import SimFleetSettings

SUMMARY = (
    "Dev only: every host of a fleet file (GPUAAS_FLEET_FILE) in one process, each as its own NATS user, "
    "in place of one gpuaas-node-agent per host."
)


def main() -> None:
    service_command_line("gpuaas-sim-fleet", SUMMARY, SimFleetSettings)
    from .fleet import main as run

    run()
