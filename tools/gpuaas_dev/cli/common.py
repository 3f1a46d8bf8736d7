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
