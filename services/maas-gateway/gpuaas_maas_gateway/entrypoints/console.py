"""`gpuaas-maas-gateway`'s command line.

Kept apart from main.py, whose imports (the bus, Postgres, the event loop) take most of a second: `--help` and
`--version` are answered with only the settings imported, and main.py is loaded only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_command_line

from ..settings import GatewaySettings

SUMMARY = "MAAS operations (allocate, deploy, release) resolved by observation."


def main() -> None:
    service_command_line("gpuaas-maas-gateway", SUMMARY, GatewaySettings)
    from .main import main as run

    run()
