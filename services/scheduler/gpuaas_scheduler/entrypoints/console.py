"""`gpuaas-scheduler`'s command line.

Kept apart from main.py, whose imports (the bus, Postgres, the event loop) take most of a second: `--help` and
`--version` are answered with only the settings imported, and main.py is loaded only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_command_line

from ..settings import SchedulerSettings

SUMMARY = "Inventory, placement and claims, and the scheduler's admin HTTP API."


def main() -> None:
    service_command_line("gpuaas-scheduler", SUMMARY, SchedulerSettings)
    from .main import main as run

    run()
