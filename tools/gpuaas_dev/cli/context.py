"""Which dev stack a command talks to, kubectl-style: `gpuaas dev up` records the stack it started as a context
(named after its run dir) and makes it the current one, so every command finds it from any directory.

Selection, strongest first: a command's own `--run-dir`; `gpuaas --context NAME` (or $GPUAAS_CONTEXT);
$GPUAAS_RUN_DIR; the current context; `.run/dev` under the working directory. The contexts live in
`$XDG_CONFIG_HOME/gpuaas/contexts.json` (default `~/.config`).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .common import (
    DEFAULT_RUN_DIR,
    EXIT_USAGE,
    err,
    pid_is_ours,
    read_stack_json,
)
from .output import OutputOpt, emit

CONTEXT_ENV = "GPUAAS_CONTEXT"
RUN_DIR_ENV = "GPUAAS_RUN_DIR"


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpuaas"


def contexts_file() -> Path:
    return config_dir() / "contexts.json"


def load() -> dict[str, Any]:
    try:
        data = json.loads(contexts_file().read_text())
    except (OSError, ValueError):
        return {"current": None, "contexts": {}}
    if not isinstance(data, dict) or not isinstance(data.get("contexts"), dict):
        return {"current": None, "contexts": {}}
    return data


def save(data: dict[str, Any]) -> None:
    path = contexts_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole and renamed: two `dev up`s at once must not leave half a file for every later command.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".contexts.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def record(run_dir: Path) -> str:
    """Remember the stack in `run_dir` and make it current; returns the context's name (the run dir's name)."""
    run_dir = run_dir.resolve()
    name = run_dir.name or "dev"
    data = load()
    before = data["contexts"].get(name, {}).get("run_dir")
    if before and before != str(run_dir):
        err.print(f"context {name} now names {run_dir} (was {before})")
    data["contexts"][name] = {"run_dir": str(run_dir)}
    data["current"] = name
    save(data)
    return name


class UnknownContext(Exception):
    pass


@dataclass(frozen=True)
class Selection:
    """The stack chosen for this invocation and why."""

    run_dir: Path
    source: str  # "--context", "$GPUAAS_CONTEXT", "$GPUAAS_RUN_DIR", "current context", "default"
    name: Optional[str] = None


def select(context: Optional[str], *, use_current: bool = True) -> Selection:
    """The run dir a command uses when it is given no `--run-dir`."""
    data = load()
    named, source = (context, "--context") if context else (os.environ.get(CONTEXT_ENV), f"${CONTEXT_ENV}")
    if named:
        entry = data["contexts"].get(named)
        if entry is None:
            raise UnknownContext(named)
        return Selection(Path(entry["run_dir"]), source, named)
    if os.environ.get(RUN_DIR_ENV):
        return Selection(Path(os.environ[RUN_DIR_ENV]).resolve(), f"${RUN_DIR_ENV}")
    current = data.get("current")
    if use_current and current in data["contexts"]:
        return Selection(Path(data["contexts"][current]["run_dir"]), "current context", current)
    return Selection(DEFAULT_RUN_DIR.resolve(), "default")


def unknown_context(name: str) -> typer.Exit:
    known = ", ".join(sorted(load()["contexts"])) or "none yet; `gpuaas dev up` records one"
    err.print(f"[red]unknown context {name!r}[/]: known contexts: {known}")
    return typer.Exit(EXIT_USAGE)


def run_dir_defaults(command: Any, run_dir: Path, skip: frozenset[tuple[str, ...]] = frozenset(), path=()) -> dict:
    """A click `default_map` that gives every command's `--run-dir` the selected stack (a `--run-dir` on the
    command line still wins); commands in `skip` keep their own default."""
    if path in skip:
        return {}
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        return {"run_dir": run_dir} if any(p.name == "run_dir" for p in command.params) else {}
    found = {}
    for name, sub in subcommands.items():
        entry = run_dir_defaults(sub, run_dir, skip, (*path, name))
        if entry:
            found[name] = entry
    return found


def stack_state(run_dir: Path) -> dict[str, Any]:
    info = read_stack_json(run_dir) or {}
    running = bool(info) and info.get("status") in ("starting", "ready") and pid_is_ours(info.get("supervisor_pid"))
    return {
        "status": (info.get("status") if running else "stopped") if info else "absent",
        "nats_url": info.get("nats_url") if running else None,
        "scheduler_admin_url": info.get("scheduler_admin_url") if running else None,
        "image_admin_url": info.get("image_admin_url") if running else None,
        "ops_admin_url": info.get("ops_admin_url") if running else None,
    }


context_app = typer.Typer(
    no_args_is_help=True,
    help="Which dev stack commands talk to (`dev up` records each stack it starts and makes it current).",
)


@context_app.command("show")
def context_show(ctx: typer.Context, output: OutputOpt = "table") -> None:
    """The stack this invocation talks to, why it was chosen, and whether it runs.

    Example: GPUAAS_RUN_DIR=.run/other gpuaas context show -o json"""
    sel: Selection = ctx.find_root().meta["selection"]
    doc = {"name": sel.name, "source": sel.source, "run_dir": str(sel.run_dir), **stack_state(sel.run_dir)}
    emit(doc, output, fields=list(doc))


@context_app.command("list")
def context_list(output: OutputOpt = "table") -> None:
    """Every recorded context; CURRENT marks the one commands use by default.

    Example: gpuaas context list -o wide"""
    data = load()
    rows = [
        {
            "current": "*" if name == data.get("current") else "",
            "name": name,
            "run_dir": entry["run_dir"],
            **stack_state(Path(entry["run_dir"])),
        }
        for name, entry in sorted(data["contexts"].items())
    ]
    emit(
        {"contexts": rows},
        output,
        rows=rows,
        columns=["current", "name", "status", "run_dir"],
        wide=["nats_url", "scheduler_admin_url"],
    )


@context_app.command("use")
def context_use(name: Annotated[str, typer.Argument(help="A context from `gpuaas context list`.")]) -> None:
    """Make NAME the current context.

    Example: gpuaas context use cli-helper"""
    data = load()
    if name not in data["contexts"]:
        raise unknown_context(name)
    data["current"] = name
    save(data)
    err.print(f"current context: {name} ({data['contexts'][name]['run_dir']})")


@context_app.command("delete")
def context_delete(name: Annotated[str, typer.Argument(help="A context from `gpuaas context list`.")]) -> None:
    """Forget NAME (the stack itself is left alone; `gpuaas dev down` stops it).

    Example: gpuaas context delete old-stack"""
    data = load()
    if data["contexts"].pop(name, None) is None:
        raise unknown_context(name)
    if data.get("current") == name:
        data["current"] = None
    save(data)
    err.print(f"context {name} deleted")
