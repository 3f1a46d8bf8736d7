"""The stack's processes: what each one is, how it is spawned, signalled and found ready."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuaas_common.identity.tls import client_context

MAAS_SIM = "maas-sim"
# The one process holding the bus's signing keys (services/credential-authority): started first, on a stack with
# bus identities only (an open bus has no keys).
AUTHORITY = "credential-authority"
# Start order; stop runs in reverse so consumers go before what they consume from.
SERVICES: tuple[str, ...] = ("image-pipeline", "allocator", "scheduler", "maas-gateway", "node-agent", "ops-view")
ALL_PROCESSES: tuple[str, ...] = (MAAS_SIM, AUTHORITY, *SERVICES)


class StackError(RuntimeError):
    """A process of the stack failed to start or become ready; the message names it and quotes its log."""


def bin_path(name: str) -> str:
    """A console script of this installation: beside the interpreter first, so a venv wins over PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise StackError(f"{name} not found; run `make setup` (pip install -e .)")
    return found


def tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _http_ok(url: str, ca_file: Path | None = None) -> bool:
    """200 from `url`; over HTTPS verified against `ca_file` only (a certificate it did not sign is not ready)."""
    try:
        context = client_context(ca_file) if ca_file is not None else None
        with urllib.request.urlopen(url, timeout=1, context=context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class _Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ready_file: Path
    ready_path: str  # HTTP path answering 200 when ready
    # Set: the process serves HTTPS with a certificate from this CA (the MAAS simulator), probed over https.
    ready_ca: Path | None = None
    proc: subprocess.Popen | None = None
    port: int | None = None  # health port (services) or API port (maas-sim)
    started_at: float | None = None
    restarts: int = 0
    # What the process wrote in its ready file, e.g. the port its admin API bound.
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def spawn(p: _Proc, cwd: Path) -> None:
    p.ready_file.unlink(missing_ok=True)
    if p.name != MAAS_SIM:
        p.port = None  # a restarted service binds a new health port; don't advertise the old one
    with p.log_path.open("ab") as log:
        log.write(f"--- gpuaas dev: starting {p.name} at {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
        log.flush()
        # A session of its own: a Ctrl-C in the developer's terminal reaches the supervisor only,
        # which then stops the services in order.
        p.proc = subprocess.Popen(
            p.argv,
            env=p.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
    p.started_at = time.monotonic()


def send_signal(p: _Proc, sig: int) -> None:
    if p.proc is not None and p.proc.poll() is None:
        try:
            p.proc.send_signal(sig)
        except ProcessLookupError:
            pass


def check_ready(p: _Proc) -> bool:
    if p.proc is None:
        return False
    try:
        info = json.loads(p.ready_file.read_text())
    except (OSError, ValueError):
        return False
    if info.get("pid") != p.proc.pid:
        return False  # a stale file of an earlier incarnation
    port = info.get("health_port") or info.get("port")
    if not port:
        return False
    p.port = int(port)
    p.info = info
    scheme = "https" if p.ready_ca is not None else "http"
    return _http_ok(f"{scheme}://127.0.0.1:{p.port}{p.ready_path}", p.ready_ca)


def wait_until_ready(pending: dict[str, _Proc], timeout_s: float) -> None:
    """Return once every process in `pending` is ready (the dict is emptied as they become so)."""
    deadline = time.monotonic() + timeout_s
    while pending:
        for name, p in list(pending.items()):
            if p.proc is not None and p.proc.poll() is not None:
                raise StackError(
                    f"{name} exited with code {p.proc.returncode} before it was ready; "
                    f"last lines of {p.log_path}:\n{tail(p.log_path)}"
                )
            if check_ready(p):
                del pending[name]
        if not pending:
            return
        if time.monotonic() >= deadline:
            name, p = next(iter(pending.items()))
            raise StackError(
                f"{', '.join(pending)} not ready after {timeout_s:.0f}s; last lines of {p.log_path}:\n"
                f"{tail(p.log_path)}"
            )
        time.sleep(0.1)
