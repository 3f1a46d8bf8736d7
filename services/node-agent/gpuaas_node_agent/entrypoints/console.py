"""`gpuaas-node-agent`'s command line: a subcommand (`discover`, `parity`, …) goes to the host-check CLI (cli.py);
otherwise `--help`/`--version` are answered, or the agent service runs. Kept apart from main.py, whose imports
(the bus, libvirt, the event loop) take about a second, so that `--help` and `--version` answer at once."""

from __future__ import annotations

import sys

from gpuaas_common.service_args import service_command_line

from ..settings import AgentSettings

SUMMARY = (
    "The agent of the one host it runs on: runs slice tasks on a slice host, or enrols a deployed baremetal host "
    "(GPUAAS_ROLE)."
)


def _commands() -> dict[str, str]:
    import typer

    from .cli import app

    group = typer.main.get_command(app)
    return {name: cmd.get_short_help_str(limit=90) for name, cmd in group.commands.items()}  # type: ignore[attr-defined]


def main() -> None:
    args = sys.argv[1:]
    if args and not args[0].startswith("-"):
        from .cli import app

        app()
        return
    service_command_line("gpuaas-node-agent", SUMMARY, AgentSettings, commands=_commands)
    from .main import serve

    serve()
