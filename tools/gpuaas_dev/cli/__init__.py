"""`gpuaas`: the developer's command line — run the embedded stack, act as a portal, watch the bus.

Results (tables, event lines, `--json` documents) go to stdout; progress and diagnostics to stderr. Exit
codes: 0 done, 1 answered with a failure, 2 bad argument (nothing published), 3 nothing to talk to (no
stack, bad URL, server down), 4 no answer in time — see `common`.

Modules: `dev` (the dev stack), `portal` (allocate, release), `follow` (an allocation's lifecycle),
`allocations` (list, show), `events` (events tail), `contract` (contract render), `maas_simulator`
(maas-sim), `bus` (NATS URL, identity, connect, publish) and `common` (consoles, exit codes, shared options,
stack.json).
"""

import os
from typing import Annotated

import typer

from gpuaas_common.service_args import package_version
from gpuaas_node_agent.entrypoints import cli as node_agent_cli

from ..identities_cli import identities_app
from ..images_cli import images_app
from .allocations import allocations_app
from .contract import contract_app
from .dev import dev_app
from .events import events_app
from .lab import lab_app
from .maas_simulator import maas_sim
from .portal import allocate, release

app = typer.Typer(no_args_is_help=True, add_completion=False, help="gpuaas developer tooling.")
app.add_typer(dev_app, name="dev")
app.add_typer(allocations_app, name="allocations")
app.add_typer(events_app, name="events")
app.add_typer(contract_app, name="contract")
app.add_typer(images_app, name="images")
app.add_typer(identities_app, name="identities")
app.add_typer(lab_app, name="lab")
app.add_typer(node_agent_cli.app, name="node-agent", help="Node agent host checks: discover, parity.")
app.command()(allocate)
app.command()(release)
app.command("maas-sim")(maas_sim)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"gpuaas {package_version()}")
        raise typer.Exit()


@app.callback()
def _top(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
) -> None:
    """gpuaas developer tooling."""


def main() -> None:
    from gpuaas_common.logging import configure_logging

    # Library logs (stream provisioning, the simulator) go to stderr so `--json` output stays parseable.
    configure_logging("gpuaas-cli", os.environ.get("GPUAAS_LOG_LEVEL", "WARNING").upper())
    app()
