"""`gpuaas-scheduler`'s command line (gpuaas_common.service_args): the heavy main is imported only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_main

from ..settings import SchedulerSettings

SUMMARY = "Inventory, placement and claims, and the scheduler's admin HTTP API."


def main() -> None:
    service_main("gpuaas-scheduler", SUMMARY, SchedulerSettings, "gpuaas_scheduler.entrypoints.main:main")
