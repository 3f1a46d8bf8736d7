"""`gpuaas dev …`: run the embedded development stack (up, down, status, the detached supervisor) and the
docker-compose init steps (fleet, maas-key, pg-roles)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer

from ..pg_roles_cli import pg_roles as _pg_roles
from .common import (
    DEFAULT_RUN_DIR,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    JsonOpt,
    RunDirOpt,
    err,
    fail,
    out,
    pid_alive,
    pid_is_ours,
    read_stack_json,
)
from .console_link import console_lines
from .output import table
from .progress import StartProgress, watch_in_background

dev_app = typer.Typer(no_args_is_help=True, help="The embedded development stack.")


class _Shutdown(BaseException):
    """Raised from a signal handler so a stack that is still starting unwinds and stops what it started."""


def _raise_shutdown(signum, _frame) -> None:
    raise _Shutdown(signum)


def _print_summary(info: dict[str, Any]) -> None:
    run_dir = Path(str(info.get("run_dir") or "."))

    def log(path: Any) -> Any:
        # Under the run dir, printed below: the table stays narrow enough not to cut a path.
        return Path(path).relative_to(run_dir) if path and Path(path).is_relative_to(run_dir) else path

    rows = [
        {"process": name, "pid": s.get("pid"), "port": s.get("health_port") or s.get("port"), "log": log(s.get("log"))}
        for name, s in info.get("services", {}).items()
    ]
    err.print(f"gpuaas dev stack ({info.get('status')})", markup=False)
    err.print(table(rows, ["process", "pid", "port", "log"]), markup=False)
    err.print(f"NATS      {info.get('nats_url')}")
    err.print(f"Postgres  {info.get('database_url')}")
    err.print(f"MAAS sim  {info.get('maas_url')}" + (f" (CA {ca})" if (ca := info.get("maas_ca_file")) else ""))
    _print_admin_apis(info, err)
    for line in console_lines(info):
        err.print(line, markup=False)
    err.print(f"run dir   {info.get('run_dir')} (stack.json, logs/)")


def _print_admin_apis(info: dict[str, Any], console: Any) -> None:
    # Their tokens are in secrets.json (0600), never printed; the README shows how to read one.
    for prefix in ("scheduler", "image", "ops"):
        url = info.get(f"{prefix}_admin_url")
        console.print(f"{prefix + ' admin API':<20} {url}  (token: {prefix}_admin_token in secrets.json)")
    console.print(f"secrets   {info.get('secrets_file')}")


def _record_context(run_dir: Path) -> None:
    from .context import record

    try:
        name = record(run_dir)
    except OSError as exc:
        # The stack runs either way; only finding it from elsewhere needs the context.
        err.print(f"[yellow]could not record the context[/]: {exc}")
        return
    err.print(f"context   {name} (current; `gpuaas context show`)")


def _supervise(stack, *, announce: bool) -> int:
    """Start the stack, keep it running (restarting crashed services with back-off), stop it on a signal."""
    from gpuaas_dev.stack import StackError

    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    try:
        try:
            stack.start()
        except StackError as exc:
            err.print(f"[red]stack failed to start[/]: {exc}")
            return 1
        if announce:
            _print_summary(stack.describe())
            _record_context(stack.run_dir)
            err.print("[green]ready[/] — Ctrl-C stops the stack")
        else:
            err.print(f"{time.strftime('%H:%M:%S')} stack ready")
        next_try: dict[str, float] = {}
        delay: dict[str, float] = {}
        while True:
            for name in stack.crashed():
                now = time.monotonic()
                if now < next_try.get(name, 0.0):
                    continue
                err.print(f"{time.strftime('%H:%M:%S')} [yellow]{name} exited; restarting[/]")
                try:
                    stack.restart(name)
                    delay.pop(name, None)
                    err.print(f"{time.strftime('%H:%M:%S')} {name} ready again (pid {stack.pid(name)})")
                except StackError as exc:
                    delay[name] = min(30.0, delay.get(name, 0.5) * 2)
                    next_try[name] = time.monotonic() + delay[name]
                    err.print(
                        f"{time.strftime('%H:%M:%S')} [red]{name} restart failed[/] "
                        f"(next try in {delay[name]:.0f}s): {exc}"
                    )
            time.sleep(0.5)
    except _Shutdown:
        err.print("stopping the stack")
        return 0
    finally:
        # A second Ctrl-C must not abandon half-stopped processes.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.stop()
        err.print("stack stopped")


def _stack_args(
    slice_hosts: int, slots: int, baremetal: int, nats_cluster: int = 1, replicas: int = 1
) -> dict[str, int]:
    return {
        "slice_hosts": slice_hosts,
        "slots_per_host": slots,
        "baremetal_hosts": baremetal,
        "nats_cluster": nats_cluster,
        "replicas": replicas,
    }


SliceHostsOpt = Annotated[int, typer.Option("--slice-hosts", min=0, help="Simulated slice hosts.")]
LabOpt = Annotated[
    bool,
    typer.Option(
        "--lab",
        help="Also a real slice host: the production agent with a QEMU/TCG hypervisor in a network namespace "
        "(stack.json: lab.netns); needs root and the lab's packages (scripts/setup.sh).",
    ),
]
SlotsOpt = Annotated[int, typer.Option("--slots", min=1, max=8, help="Slots (GPUs) per slice host.")]
BaremetalOpt = Annotated[int, typer.Option("--baremetal", min=0, help="Baremetal machines in MAAS.")]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="The services' log level (DEBUG, INFO, …).")]
NatsClusterOpt = Annotated[
    int,
    typer.Option(
        "--nats-cluster",
        help="NATS servers: 1, or 3 (or 5) in one JetStream cluster with every stream replicated 3 times.",
    ),
]
ReplicasOpt = Annotated[
    int, typer.Option("--replicas", min=1, max=8, help="Processes of each service; they share their durables.")
]
UnsafeNoFsyncOpt = Annotated[
    bool,
    typer.Option(
        "--unsafe-no-fsync",
        help="Run Postgres with fsync and synchronous_commit off: faster, but a crash can lose the last commits. "
        "For tests and benchmarks only; without it the stack is durable.",
    ),
]


PgTlsOpt = Annotated[
    bool,
    typer.Option(
        "--pg-tls",
        help="Postgres over TLS only (a CA of the stack's own, stack.json: postgres_ca_file); every DSN "
        "verifies the server (sslmode=verify-full).",
    ),
]


@dev_app.command("up")
def dev_up(
    detach: Annotated[bool, typer.Option("--detach", help="Leave a supervisor running in the background.")] = False,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    slice_hosts: SliceHostsOpt = 4,
    slots: SlotsOpt = 8,
    baremetal: BaremetalOpt = 2,
    log_level: LogLevelOpt = "INFO",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the stack to be ready.")] = 180.0,
    unsafe_no_fsync: UnsafeNoFsyncOpt = False,
    nats_cluster: NatsClusterOpt = 1,
    replicas: ReplicasOpt = 1,
    lab: LabOpt = False,
    pg_tls: PgTlsOpt = False,
) -> None:
    """Start NATS, Postgres, the MAAS simulator and the five services; return once all are ready.

    Example: gpuaas dev up --detach --lab   (a real slice host too: QEMU/TCG in a namespace; needs root)
    """
    if nats_cluster not in (1, 3, 5):
        raise typer.BadParameter("1, 3 or 5 (a JetStream cluster needs a majority)", param_hint="--nats-cluster")
    from gpuaas_dev.stack import Stack

    run_dir = run_dir.resolve()
    info = read_stack_json(run_dir)
    if info and info.get("status") in ("starting", "ready") and pid_is_ours(info.get("supervisor_pid")):
        err.print(
            f"[red]a stack is already running in {run_dir}[/] (supervisor pid {info['supervisor_pid']}); "
            f"`gpuaas dev down --run-dir {run_dir}` first"
        )
        raise typer.Exit(1)
    if not detach:
        stack = Stack(
            run_dir,
            log_level=log_level,
            unsafe_no_fsync=unsafe_no_fsync,
            lab=lab,
            lab_baremetal=lab,
            pg_tls=pg_tls,
            **_stack_args(slice_hosts, slots, baremetal, nats_cluster, replicas),
        )
        watch_in_background(run_dir, os.getpid(), err.print)
        raise typer.Exit(_supervise(stack, announce=True))

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "stack.json").unlink(missing_ok=True)
    log_path = run_dir / "logs" / "supervisor.log"
    argv = [
        sys.executable,
        "-m",
        "gpuaas_dev.cli",
        "dev",
        "supervise",
        "--run-dir",
        str(run_dir),
        "--slice-hosts",
        str(slice_hosts),
        "--slots",
        str(slots),
        "--baremetal",
        str(baremetal),
        "--log-level",
        log_level,
        *(["--unsafe-no-fsync"] if unsafe_no_fsync else []),
        "--nats-cluster",
        str(nats_cluster),
        "--replicas",
        str(replicas),
        *(["--lab"] if lab else []),
        *(["--pg-tls"] if pg_tls else []),
    ]
    with log_path.open("ab") as log:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=Path.cwd()
        )
    err.print(f"supervisor pid {child.pid}; waiting for the stack (log: {log_path})")
    from gpuaas_dev.stack import tail

    progress = StartProgress(run_dir, child.pid)
    deadline = time.monotonic() + timeout
    while True:
        code = child.poll()
        if code is not None:
            err.print(f"[red]the supervisor exited with code {code}[/]; last lines of {log_path}:\n{tail(log_path)}")
            raise typer.Exit(1)
        for line in progress.poll():
            err.print(line)
        info = read_stack_json(run_dir)
        if info and info.get("status") == "ready" and info.get("supervisor_pid") == child.pid:
            _print_summary(info)
            _record_context(run_dir)
            err.print(f"[green]ready[/] — `gpuaas dev down --run-dir {run_dir}` stops it")
            return
        if time.monotonic() > deadline:
            err.print(
                f"[red]stack not ready after {timeout:.0f}s[/]; stopping it. Last lines of {log_path}:\n"
                f"{tail(log_path)}"
            )
            child.terminate()
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
            raise typer.Exit(1)
        time.sleep(0.2)


@dev_app.command("supervise", hidden=True)
def dev_supervise(
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    slice_hosts: SliceHostsOpt = 4,
    slots: SlotsOpt = 8,
    baremetal: BaremetalOpt = 2,
    log_level: LogLevelOpt = "INFO",
    unsafe_no_fsync: UnsafeNoFsyncOpt = False,
    nats_cluster: NatsClusterOpt = 1,
    replicas: ReplicasOpt = 1,
    lab: LabOpt = False,
    pg_tls: PgTlsOpt = False,
) -> None:
    """The detached supervisor behind `dev up --detach`."""
    from gpuaas_dev.stack import Stack

    stack = Stack(
        run_dir.resolve(),
        log_level=log_level,
        unsafe_no_fsync=unsafe_no_fsync,
        lab=lab,
        lab_baremetal=lab,
        pg_tls=pg_tls,
        **_stack_args(slice_hosts, slots, baremetal, nats_cluster, replicas),
    )
    raise typer.Exit(_supervise(stack, announce=False))


@dev_app.command("down")
def dev_down(
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for a clean stop.")] = 60.0,
) -> None:
    """Stop the stack started by `dev up` in this run dir (SIGTERM to its supervisor).

    Example: gpuaas --context cli-helper dev down"""
    run_dir = run_dir.resolve()
    info = read_stack_json(run_dir)
    if info is None:
        err.print(f"no stack in {run_dir}")
        return
    pid = info.get("supervisor_pid")
    if not pid_is_ours(pid):
        _stop_leftovers(info)
        _down_leftover_lab(run_dir)
        err.print(f"no stack running in {run_dir}")
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        err.print(f"[yellow]supervisor {pid} did not stop within {timeout:.0f}s; killing it and its services[/]")
        os.kill(pid, signal.SIGKILL)
        _stop_leftovers(info)
    _down_leftover_lab(run_dir)
    err.print(f"stack in {run_dir} stopped")


def _down_leftover_lab(run_dir: Path) -> None:
    """A lab whose supervisor did not take it down (killed): its lab.json says what to remove."""
    from gpuaas_dev.lab.lab import Lab

    lab = Lab.load(run_dir / "lab")
    if lab is not None:
        for problem in lab.down():
            err.print(f"[yellow]lab: left behind: {problem}[/]")


def _stop_leftovers(info: dict[str, Any]) -> None:
    """Last resort when the supervisor is gone: the service PIDs it recorded, if they are still gpuaas."""
    pids = [s.get("pid") for s in info.get("services", {}).values()] + list(info.get("nats_pids") or [])
    for pid in pids:
        if pid_is_ours(pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


@dev_app.command("status")
def dev_status(run_dir: RunDirOpt = DEFAULT_RUN_DIR, as_json: JsonOpt = False) -> None:
    """The stack's processes and whether each answers /readyz: a table on stdout, or --json. Exit 0 when the stack
    runs and every process is ready, 1 when one is not, 3 when no stack runs there.

    Example: gpuaas dev status --json"""
    run_dir = run_dir.resolve()
    info = read_stack_json(run_dir)
    if info is None:
        if as_json:
            typer.echo(json.dumps({"running": False, "status": "absent", "run_dir": str(run_dir), "services": {}}))
        raise fail(f"no stack in {run_dir} (`gpuaas dev up --detach --run-dir {run_dir}` starts one)", EXIT_UNREACHABLE)
    from gpuaas_common.identity.tls import client_context

    running = pid_is_ours(info.get("supervisor_pid")) and info.get("status") in ("starting", "ready")
    rows = {}
    for name, s in info.get("services", {}).items():
        port = s.get("health_port") or s.get("port")
        path = "/_sim/healthz" if name == "maas-sim" else "/readyz"
        # The simulator serves HTTPS from the stack's CA (stack.json's maas_ca_file), verified against it alone.
        ca = info.get("maas_ca_file") if name == "maas-sim" else None
        ready = False
        if running and port and pid_alive(s.get("pid")):
            try:
                context = client_context(ca) if ca else None
                url = f"{'https' if ca else 'http'}://127.0.0.1:{port}{path}"
                with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                    ready = resp.status == 200
            except (urllib.error.URLError, OSError):
                ready = False
        rows[name] = {"pid": s.get("pid"), "port": port, "ready": ready, "restarts": s.get("restarts", 0)}
    summary = {
        "running": running,
        "status": info.get("status") if running else "stopped",
        "nats_url": info.get("nats_url"),
        "maas_url": info.get("maas_url"),
        "scheduler_admin_url": info.get("scheduler_admin_url"),
        "image_admin_url": info.get("image_admin_url"),
        "services": rows,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        out.print(f"gpuaas dev stack in {run_dir}: {summary['status']}", markup=False)
        listed = [{"process": name, **r} for name, r in rows.items()]
        out.print(table(listed, ["process", "pid", "port", "ready", "restarts"]), markup=False)
        if running:
            _print_admin_apis(info, out)
    # The table's codes: nothing to talk to is 3 (a stopped stack too); a stack that runs with a process not ready
    # is an answer, and a failing one.
    raise typer.Exit(EXIT_UNREACHABLE if not running else 0 if all(r["ready"] for r in rows.values()) else EXIT_FAILED)


@dev_app.command("fleet")
def dev_fleet(
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Directory for fleet.json, maas-machines.json, images/.")],
    slice_hosts: SliceHostsOpt = 4,
    slots: SlotsOpt = 8,
    baremetal: BaremetalOpt = 2,
    ssh_port: Annotated[int, typer.Option("--ssh-port", help="Port the simulated guests answer SSH on.")] = 2222,
) -> None:
    """Write a simulated fleet, its MAAS machine list and the seed images (used by docker-compose).

    Example: gpuaas dev fleet --out-dir fleet --slice-hosts 2 --baremetal 1"""
    from gpuaas_dev.stack import prepare_fleet_dir

    files = prepare_fleet_dir(
        out_dir, slice_hosts=slice_hosts, slots_per_host=slots, baremetal_hosts=baremetal, ssh_port=ssh_port
    )
    for kind, path in files.items():
        err.print(f"{kind:9} {path}")


@dev_app.command("maas-key")
def dev_maas_key() -> None:
    """Print a fresh MAAS-shaped API key (for GPUAAS_MAAS_API_KEY in docker-compose).

    Example: export GPUAAS_MAAS_API_KEY=$(gpuaas dev maas-key)"""
    from gpuaas_dev.maas_sim import generate_api_key

    typer.echo(str(generate_api_key()))


# --- Postgres roles (docker-compose's init step) --------------------------------------------------------------

dev_app.command("pg-roles")(_pg_roles)
