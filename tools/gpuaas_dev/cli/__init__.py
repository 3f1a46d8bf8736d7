"""`gpuaas`: the developer's command line — run the embedded stack, act as a portal, watch the bus.

Results (tables, event lines, `--json` documents) go to stdout; progress and diagnostics to stderr. Exit
codes: 0 done, 1 answered with a failure, 2 bad argument (nothing published), 3 nothing to talk to (no
stack, bad URL, server down), 4 no answer in time — see `common`.

Modules: `dev` (the dev stack), `progress` (dev up's readiness lines), `logs` (dev logs), `context` (which
stack a command talks to), `portal` (allocate, release), `follow` (an allocation's lifecycle), `allocations`
(list, show, wait), `inventory` (nodes, slots, quota, wipe-policy, force-release, api docs over the scheduler's
admin API, through `admin_api`), `images` (the image pipeline's admin API), `identities` (keys, creds, hosts),
`dlq` (dead letters), `usage` (usage export over the ops API), `events` (events tail), `contract` (contract
render), `maas_simulator` (maas-sim), `bus` (NATS URL, identity, connect, publish), `output` (-o, AGE, --watch)
and `common` (consoles, exit codes and their wording, shared options, stack.json).
"""

import os
from typing import Annotated, Optional

import typer

from gpuaas_common.service_args import package_version
from gpuaas_node_agent.entrypoints import cli as node_agent_cli

from ..identity_cli import set_insecure_dev_flag
from .allocations import allocations_app
from .common import OneLineUsageErrors
from .console_link import console
from .context import UnknownContext, context_app, run_dir_defaults, select, unknown_context
from .contract import contract_app
from .dev import dev_app
from .dlq import dlq_app
from .events import events_app
from .identities import identities_app
from .images import images_app
from .inventory import api_app, force_release, nodes_app, quota_app, slots_app, wipe_policy_app
from .lab import lab_app
from .logs import dev_logs
from .maas_simulator import maas_sim
from .output import choices
from .portal import allocate, release
from .usage import usage_app

# Completion is the explicit `gpuaas completion SHELL` (kubectl's way) rather than typer's
# --install-completion, which edits the user's shell start-up files.
app = typer.Typer(
    cls=OneLineUsageErrors,
    no_args_is_help=True,
    add_completion=False,
    help="gpuaas developer tooling.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
dev_app.command("logs")(dev_logs)
app.add_typer(dev_app, name="dev")
app.add_typer(context_app, name="context")
allocations_app.command("force-release")(force_release)
app.add_typer(allocations_app, name="allocations")
app.add_typer(nodes_app, name="nodes")
app.add_typer(slots_app, name="slots")
app.add_typer(quota_app, name="quota")
app.add_typer(wipe_policy_app, name="wipe-policy")
app.add_typer(api_app, name="api")
app.add_typer(dlq_app, name="dlq")
app.add_typer(events_app, name="events")
app.add_typer(contract_app, name="contract")
app.add_typer(images_app, name="images")
app.add_typer(identities_app, name="identities")
app.add_typer(lab_app, name="lab")
app.add_typer(usage_app, name="usage")
app.add_typer(node_agent_cli.app, name="node-agent", help="Node agent host checks: discover, parity.")
app.command()(allocate)
app.command("console")(console)
app.command()(release)
app.command("maas-sim")(maas_sim)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"gpuaas {package_version()}")
        raise typer.Exit()


Shell = choices("Shell", ("bash", "zsh", "fish"))
# Commands whose --run-dir names something else than the stack to talk to: `dev up` starts one (the current
# context must not send a new stack into another checkout's run dir), the lab keeps its own.
OWN_RUN_DIR = frozenset({("dev", "up"), ("dev", "supervise"), ("lab",)})


@app.command("completion")
def completion(shell: Annotated[Shell, typer.Argument(help="bash, zsh or fish.")]) -> None:  # type: ignore[valid-type]
    """Print the shell completion script for SHELL.

    Example: source <(gpuaas completion bash)   (zsh: the same; fish: gpuaas completion fish | source)"""
    from typer._completion_shared import get_completion_script

    typer.echo(get_completion_script(prog_name="gpuaas", complete_var="_GPUAAS_COMPLETE", shell=shell.value))


@app.callback()
def _top(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
    context: Annotated[
        Optional[str],
        typer.Option(
            "--context",
            help="Talk to this recorded stack (`gpuaas context list`). Default: $GPUAAS_CONTEXT, else "
            "$GPUAAS_RUN_DIR, else the current context.",
        ),
    ] = None,
    insecure_dev: Annotated[
        bool,
        typer.Option(
            "--insecure-dev",
            help="Allow a plaintext nats:// bus or tls:// without a CA: an open dev bus only. Also "
            "$GPUAAS_NATS_INSECURE_DEV=true.",
        ),
    ] = False,
) -> None:
    """gpuaas developer tooling."""
    set_insecure_dev_flag(insecure_dev)
    try:
        selection = select(context)
        started = select(context, use_current=False)
    except UnknownContext as exc:
        if ctx.resilient_parsing:
            return
        raise unknown_context(str(exc)) from None
    ctx.meta["selection"] = selection
    defaults = run_dir_defaults(ctx.command, selection.run_dir, OWN_RUN_DIR) if selection.source != "default" else {}
    if started.source != "default":
        defaults.setdefault("dev", {})["up"] = {"run_dir": started.run_dir}
    ctx.default_map = defaults or None


def main() -> None:
    from typer._completion_classes import completion_init

    from gpuaas_common.logging import configure_logging

    completion_init()  # typer registers its completion classes only when it adds --install-completion

    # Library logs (stream provisioning, the simulator) go to stderr so `--json` output stays parseable.
    configure_logging("gpuaas-cli", os.environ.get("GPUAAS_LOG_LEVEL", "WARNING").upper())
    app()
