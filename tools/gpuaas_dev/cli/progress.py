"""`dev up`'s running account of a stack coming up: one line per part as it becomes ready, with the seconds since
the start, read from what the supervisor leaves in the run dir (stack.json, each process's ready file), so the
same watcher serves a detached supervisor and one in this process alike."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional


def _read(path: Path) -> Optional[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class StartProgress:
    """`poll()` returns the lines for what became ready since the last poll; `done` once the stack is ready."""

    def __init__(self, run_dir: Path, supervisor_pid: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir, self.supervisor_pid, self.clock = run_dir, supervisor_pid, clock
        self.started = clock()
        self.seen: set[str] = set()
        self.done = False

    def _line(self, what: str, detail: str = "") -> str:
        return f"{self.clock() - self.started:6.1f}s  {what:<22} ready{detail}"

    def poll(self) -> list[str]:
        info = _read(self.run_dir / "stack.json")
        # A stack.json of an earlier stack in this run dir says nothing about this one.
        if self.done or info is None or info.get("supervisor_pid") != self.supervisor_pid:
            return []
        lines = []
        parts = [
            ("nats", info.get("nats_url")),
            ("postgres", info.get("database_url")),
            ("registry", info.get("registry_url")),
        ]
        for name, where in parts:
            if where and name not in self.seen:
                self.seen.add(name)
                lines.append(self._line(name, f"  {where}"))
        for name, proc in (info.get("services") or {}).items():
            if name in self.seen or not proc.get("pid"):
                continue
            ready = _read(self.run_dir / "ready" / f"{name}.json")
            if ready and ready.get("pid") == proc["pid"]:
                self.seen.add(name)
                lines.append(self._line(name, f"  pid {proc['pid']}"))
        if info.get("status") == "ready":
            self.done = True
            lines.append(self._line("stack", " (hosts commissioned, slots approved)"))
        return lines


def watch_in_background(run_dir: Path, supervisor_pid: int, emit: Callable[[str], None]) -> threading.Event:
    """For a stack started in this process: a daemon thread prints each part as it becomes ready until the stack
    is, or until the returned event is set."""
    stop = threading.Event()
    progress = StartProgress(run_dir, supervisor_pid)

    def run() -> None:
        while not stop.is_set() and not progress.done:
            for line in progress.poll():
                emit(line)
            stop.wait(0.2)

    threading.Thread(target=run, name="dev-up-progress", daemon=True).start()
    return stop
