"""`gpuaas dev logs [-f] [SERVICE…]`: the dev stack's log files (one per process, JSON lines) made readable: time,
level, process, event, then the ids an operator follows a request by (allocation, task, operation), then the rest.
`--json` passes the lines through untouched for scripts. Colour only on a terminal."""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from .common import DEFAULT_RUN_DIR, EXIT_USAGE, RunDirOpt, fail, no_stack, out

# The ids that tie a line to what an operator is chasing: always right after the event, in this order.
IDS = ("allocation_id", "task_id", "operation_id")
_SHOWN = {"timestamp", "level", "service", "event", "exception", *IDS}
_LEVEL_STYLE = {"debug": "dim", "info": "green", "warning": "yellow", "error": "red", "critical": "bold red"}
_PLAIN = re.compile(r"^[\w.:/@+-]+$")


def _value(v: Any) -> str:
    if isinstance(v, str):
        return v if _PLAIN.match(v) else json.dumps(v, ensure_ascii=False)
    return json.dumps(v, default=str, separators=(",", ":"), ensure_ascii=False)


def render_line(process: str, line: str, *, colour: bool) -> str:
    """One log line as rich markup (markup escaped, so a value can never style the terminal)."""
    text = line.rstrip("\n")
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or "event" not in rec:
        return f"[dim]{escape(process)} | {escape(text)}[/]" if colour else f"{process} | {text}"
    ts = str(rec.get("timestamp", ""))
    at = ts[11:23] if len(ts) >= 23 else ts  # HH:MM:SS.mmm of an ISO time
    level = str(rec.get("level", "")).lower()
    ids = [f"{k}={_value(rec[k])}" for k in IDS if rec.get(k) is not None]
    rest = [f"{k}={_value(v)}" for k, v in rec.items() if k not in _SHOWN]
    parts = [at, f"{level:<7}", f"{process:<16}", str(rec["event"]), *ids, *rest]
    if not colour:
        rendered = " ".join(parts)
    else:
        style = _LEVEL_STYLE.get(level, "")
        head = [f"[dim]{escape(at)}[/]", f"[{style}]{escape(parts[1])}[/]" if style else escape(parts[1])]
        head += [f"[cyan]{escape(parts[2])}[/]", f"[bold]{escape(parts[3])}[/]"]
        head += [f"[magenta]{escape(i)}[/]" for i in ids] + [escape(r) for r in rest]
        rendered = " ".join(head)
    if rec.get("exception"):
        exc = "\n".join(f"    {x}" for x in str(rec["exception"]).splitlines())
        rendered += "\n" + (f"[red]{escape(exc)}[/]" if colour else exc)
    return rendered


def log_files(logs_dir: Path, wanted: Iterable[str]) -> dict[str, Path]:
    """The log file of each process asked for: a service's name takes its replicas too (scheduler-2)."""
    files = {p.stem: p for p in sorted(logs_dir.glob("*.log"), key=lambda p: p.stem)}
    wanted = list(wanted)
    if not wanted:
        return files
    chosen: dict[str, Path] = {}
    for name in wanted:
        matches = {s: p for s, p in files.items() if s == name or re.fullmatch(rf"{re.escape(name)}-\d+", s)}
        if not matches:
            raise fail(f"[red]no log of {name!r}[/] in {logs_dir}; there are: {', '.join(files) or 'none'}", EXIT_USAGE)
        chosen.update(matches)
    return chosen


def _timestamp(line: str) -> Optional[str]:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return str(rec.get("timestamp")) if isinstance(rec, dict) and rec.get("timestamp") else None


def history(files: dict[str, Path], tail: int) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Every process's last `tail` lines (all with a negative tail), merged in time order, and where each file's
    complete lines end (where following it goes on). A line without a time (a start banner, a traceback) keeps
    its place after the line before it in its own file."""
    merged: list[tuple[str, int, str, str]] = []
    ends: dict[str, int] = {}
    for process, path in files.items():
        try:
            data = path.read_bytes()
        except OSError:
            ends[process] = 0
            continue
        end = data.rfind(b"\n") + 1  # a line still being written is left to the follower
        ends[process] = end
        lines = data[:end].decode(errors="replace").splitlines()
        if tail >= 0:
            lines = lines[-tail:] if tail else []
        last = ""
        for i, line in enumerate(lines):
            last = _timestamp(line) or last
            merged.append((last, i, process, line))
    merged.sort(key=lambda m: (m[0], m[2], m[1]))
    return [(process, line) for _, _, process, line in merged], ends


@dataclass
class Follower:
    """Reads what is appended to each file from where it stands now; a file that shrank or was replaced (a
    restarted stack) is read again from its start. A line is handed on only once its newline is there."""

    files: dict[str, Path]
    offsets: dict[str, int]
    partial: dict[str, bytes] = field(default_factory=dict)
    inodes: dict[str, int] = field(default_factory=dict)

    def read(self) -> list[tuple[str, str]]:
        got: list[tuple[str, str]] = []
        for process, path in self.files.items():
            try:
                st = path.stat()
            except OSError:
                continue
            size, replaced = st.st_size, self.inodes.setdefault(process, st.st_ino) != st.st_ino
            if size < self.offsets[process] or replaced:
                self.offsets[process], self.partial[process], self.inodes[process] = 0, b"", st.st_ino
            if size == self.offsets[process]:
                continue
            with path.open("rb") as f:
                f.seek(self.offsets[process])
                data = self.partial.pop(process, b"") + f.read(size - self.offsets[process])
            self.offsets[process] = size
            *complete, rest = data.split(b"\n")
            if rest:
                self.partial[process] = rest
            got += [(process, c.decode(errors="replace")) for c in complete]
        return got


def follow(follower: Follower, emit: Callable[[str, str], None], stop: threading.Event, interval: float = 0.2) -> None:
    """Hand on each new line until `stop` is set (Ctrl-C ends the command itself)."""
    while True:
        for process, line in follower.read():
            emit(process, line)
        if stop.wait(interval):
            return


def dev_logs(
    services: Annotated[
        Optional[list[str]],
        typer.Argument(help="Processes to show (a service takes its replicas too). Default: all of them."),
    ] = None,
    follow_: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing lines as they are written, until Ctrl-C.")
    ] = False,
    tail: Annotated[int, typer.Option("--tail", "-n", help="Lines of each log to show first (-1: all of them).")] = -1,
    as_json: Annotated[bool, typer.Option("--json", help="Pass the JSON lines through as written.")] = False,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """The stack's logs, readable: time, level, process, event, then allocation_id, task_id and operation_id, then
    the other keys; coloured on a terminal. The logs of a stopped stack stay readable until the next `dev up`.

    Example: gpuaas dev logs -f allocator scheduler --tail 20"""
    logs_dir = run_dir / "logs"
    if not logs_dir.is_dir():
        raise no_stack("logs", run_dir, "pass --run-dir or --context")
    files = log_files(logs_dir, services or [])
    colour = sys.stdout.isatty() and not as_json

    def emit(process: str, line: str) -> None:
        if as_json:
            typer.echo(line)
        elif colour:
            out.print(render_line(process, line, colour=True))
        else:
            typer.echo(render_line(process, line, colour=False))

    lines, ends = history(files, tail)
    for process, line in lines:
        emit(process, line)
    if follow_:
        try:
            # From where the history stopped reading: no line twice, none lost in between.
            follow(Follower(files, dict(ends)), emit, threading.Event())
        except KeyboardInterrupt:
            return
