"""What every `gpuaas` command shares: the consoles, the exit codes, the common options and the run dir's
stack.json.

Human output (tables, results) goes to stdout (`out`); progress and diagnostics go to stderr (`err`), so
`--json` output and pipes stay clean. Neither console wraps: one line stays one line at any width."""

import json
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer parses with its own copy of click, and raises its exceptions
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # a typer that uses click itself
    from click.exceptions import NoArgsIsHelpError, UsageError  # type: ignore[assignment]

DEFAULT_RUN_DIR = Path(".run/dev")

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)

# Exit codes every command keeps to, so a script can tell an answer from a broken set-up.
EXIT_OK = 0
EXIT_FAILED = 1  # the operation was answered with a failure (rejected, failed, not found)
EXIT_USAGE = 2  # a bad argument, refused before anything was published (typer's own usage errors too)
EXIT_UNREACHABLE = 3  # no bus or API to talk to: bad or missing URL, server down, missing creds
EXIT_TIMEOUT = 4  # nobody answered in time


def fail(message: str, code: int) -> typer.Exit:
    """Print one diagnostic line on stderr; `raise fail(...)` ends the command with `code`."""
    err.print(message)
    return typer.Exit(code)


# One wording per kind of error, whichever command meets it (tests/unit/test_cli_errors.py runs every command
# with each kind of bad input and holds them to these lines and codes).


def bad_id(kind: str, value: str) -> typer.Exit:
    return fail(f"[red]invalid {kind} id {value!r}[/]: not a UUID", EXIT_USAGE)


def not_found(kind: str, name: object) -> typer.Exit:
    return fail(f"[red]no {kind} {name}[/]", EXIT_FAILED)


def no_stack(what: str, run_dir: Path, how: str) -> typer.Exit:
    """Nothing to talk to: no running stack in the selected run dir and nothing given instead."""
    return fail(
        f"[red]no {what}[/]: no stack runs in {run_dir.absolute()}; {how}, or start one (`gpuaas dev up --detach`, "
        "which makes it the current context)",
        EXIT_UNREACHABLE,
    )


def unreachable(what: str, where: str, reason: str) -> typer.Exit:
    return fail(f"[red]cannot connect to {what} at {where}[/]: {reason}", EXIT_UNREACHABLE)


def refused(what: str, reason: str) -> typer.Exit:
    """The server is there but does not accept who we are: wrong token or credentials."""
    return fail(f"[red]refused by {what}[/]: {reason} (check the token or credentials)", EXIT_UNREACHABLE)


def timed_out(what: str, seconds: float, hint: str = "") -> typer.Exit:
    return fail(f"[red]{what} did not answer within {seconds:g}s[/]{hint}", EXIT_TIMEOUT)


def usage_error(exc: Any) -> typer.Exit:
    """A usage error of the parser (missing argument, unknown option or command, a value it refuses) as one line on
    stderr, exit 2, like every other bad argument: no usage block, no box."""
    names = []
    ctx = getattr(exc, "ctx", None)
    while ctx is not None and ctx.parent is not None:  # the root by its name, whatever it was run as
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    path = " ".join(["gpuaas", *names])
    message = " ".join(exc.format_message().split()).replace("Value error, ", "").rstrip(".")
    message = message[:1].lower() + message[1:]
    return fail(f"[red]{escape(path)}: {escape(message)}[/] (`{escape(path)} -h` for help)", EXIT_USAGE)


class OneLineUsageErrors(TyperGroup):
    """The top-level group: the parser's usage errors, wherever in the command tree they are met (a subcommand's
    arguments are parsed while its parent group invokes it), end as `usage_error` says. `NoArgsIsHelpError` (a
    group given no subcommand) still prints the group's help."""

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except UsageError as exc:
            if isinstance(exc, NoArgsIsHelpError):
                raise
            raise usage_error(exc) from None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            if isinstance(exc, NoArgsIsHelpError):
                raise
            raise usage_error(exc) from None


RunDirOpt = Annotated[Path, typer.Option("--run-dir", help="Where the dev stack keeps its state and logs.")]
NatsUrlOpt = Annotated[
    Optional[str],
    typer.Option("--nats-url", help="Default: $GPUAAS_NATS_URL, else the running dev stack's stack.json."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
CredsOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--creds",
        help="NATS .creds file to act with. Default: $GPUAAS_NATS_CREDS, else the dev "
        "stack's creds for this command's role (portal for allocate/release, ops "
        "for events tail).",
    ),
]


def read_stack_json(run_dir: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((run_dir / "stack.json").read_text())
    except (OSError, ValueError):
        return None


def pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_is_ours(pid: Optional[int]) -> bool:
    """Alive and still a gpuaas process: a PID from an old stack.json may have been reused."""
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return True  # no procfs: trust the liveness check
    return b"gpuaas" in cmdline or b"nats-server" in cmdline
