"""`gpuaas-sim-fleet`'s command line (gpuaas_common.service_args): the heavy main is imported only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_main

from .settings import SimFleetSettings

SUMMARY = (
    "Dev only: every host of a fleet file (GPUAAS_FLEET_FILE) in one process, each as its own NATS user, "
    "in place of one gpuaas-node-agent per host."
)


def main() -> None:
    service_main("gpuaas-sim-fleet", SUMMARY, SimFleetSettings, "gpuaas_dev.sim.fleet:main")
