"""`gpuaas`: the developer's command line — run the embedded stack, act as a portal, watch the bus.

Human-readable progress goes to stderr (rich); `--json` puts one machine-readable result on stdout.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from gpuaas_node_agent.entrypoints import cli as node_agent_cli

from .identity_cli import cli_identity

DEFAULT_RUN_DIR = Path(".run/dev")
ALLOCATION_EVENTS = "gpuaas.allocation.event.>"
TASK_PROGRESS = "gpuaas.node.*.report.task_progress"
DEFAULTS = {
    "gpu_slice": {"sku": "h200-sxm-slice", "image": "ubuntu-24.04-h200-slice", "gpus": 1},
    "baremetal": {"sku": "h200-sxm", "image": "ubuntu-24.04-h200-host", "gpus": 8},
}

# Used when no --ssh-key is given and the developer has no key of their own: the simulated guests
# refuse to boot without one, and a dev VM is never reachable from outside the loopback fleet.
DEV_SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuaWFhcy1kZXYtb25seS1ub3QtYS1yZWFsLWtleQ gpuaas-dev"

err = Console(stderr=True, highlight=False)

app = typer.Typer(no_args_is_help=True, add_completion=False, help="gpuaas developer tooling.")
dev_app = typer.Typer(no_args_is_help=True, help="The embedded development stack.")
events_app = typer.Typer(no_args_is_help=True, help="Watch the event bus.")
contract_app = typer.Typer(no_args_is_help=True, help="The AsyncAPI contract.")
app.add_typer(dev_app, name="dev")
app.add_typer(events_app, name="events")
app.add_typer(contract_app, name="contract")
from .images_cli import images_app  # noqa: E402

app.add_typer(images_app, name="images")
from .identities_cli import identities_app  # noqa: E402

app.add_typer(identities_app, name="identities")
app.add_typer(node_agent_cli.app, name="node-agent", help="Node agent host checks: discover, parity.")

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


# --- helpers ------------------------------------------------------------------------------------------


def _read_stack_json(run_dir: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((run_dir / "stack.json").read_text())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_is_ours(pid: Optional[int]) -> bool:
    """Alive and still a gpuaas process: a PID from an old stack.json may have been reused."""
    if not _pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return True  # no procfs: trust the liveness check
    return b"gpuaas" in cmdline or b"nats-server" in cmdline


def _resolve_nats_url(nats_url: Optional[str], run_dir: Path) -> str:
    if nats_url:
        return nats_url
    if os.environ.get("GPUAAS_NATS_URL"):
        return os.environ["GPUAAS_NATS_URL"]
    info = _read_stack_json(run_dir)
    if info and info.get("nats_url") and info.get("status") == "ready" and _pid_alive(info.get("supervisor_pid")):
        return info["nats_url"]
    err.print(
        f"[red]no NATS URL[/]: pass --nats-url, set GPUAAS_NATS_URL, or start the stack "
        f"(`gpuaas dev up --detach --run-dir {run_dir}`)"
    )
    raise typer.Exit(2)


def _identity(url: str, creds: Optional[Path], run_dir: Path, role: str):
    try:
        return cli_identity(url, creds, run_dir, role)
    except FileNotFoundError as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None


async def _connect(identity, closed_cb=None):
    import nats

    extra = {"closed_cb": closed_cb} if closed_cb else {}
    try:
        return await nats.connect(
            **identity.connect_kwargs(),
            connect_timeout=3,
            max_reconnect_attempts=2,
            reconnect_time_wait=0.5,
            name="gpuaas-cli",
            **extra,
        )
    except Exception as exc:  # nats-py raises several unrelated types for "nobody there"
        reason = str(exc) or type(exc).__name__
        err.print(f"[red]cannot connect to NATS at {', '.join(identity.servers)} as {identity.name}[/]: {reason}")
        raise typer.Exit(2) from None


async def _publish(js, type_: str, payload: dict[str, Any], correlation_id: str) -> str:
    from gpuaas_common.contract import Envelope, spec_for

    # No provisioning here: streams belong to the admin identity, and a portal or an operator's laptop
    # must not be able to create or change them. A missing stream shows up as "no stream acknowledged".
    env = Envelope.wrap(type_, payload, producer="gpuaas-cli", correlation_id=correlation_id)
    subject = spec_for(type_).subject()
    ack = await js.publish(subject, env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id})
    if not ack.stream:
        err.print(f"[red]{subject}: no stream acknowledged the message[/]")
        raise typer.Exit(1)
    if ack.duplicate:
        err.print(f"[yellow]{subject}: JetStream reports a duplicate of event {env.event_id}[/]")
    return env.event_id


def _ssh_keys(given: Optional[list[str]]) -> list[str]:
    """Key text or a path to a .pub file; default: the developer's own public key, else DEV_SSH_KEY."""
    keys = []
    for item in given or []:
        path = Path(item).expanduser()
        keys.append(path.read_text().strip() if path.is_file() else item.strip())
    if keys:
        return keys
    for name in ("id_ed25519.pub", "id_ecdsa.pub", "id_rsa.pub"):
        path = Path.home() / ".ssh" / name
        if path.is_file():
            return [path.read_text().strip()]
    return [DEV_SSH_KEY]


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def _describe_event(kind: str, payload: dict[str, Any]) -> str:
    p = payload
    if kind == "accepted":
        return f"accepted: {p.get('sku')} × {p.get('gpu_count')} GPU, image {p.get('image', {}).get('slug')}"
    if kind == "placed":
        slots = ", ".join(s["slot_id"] for s in p.get("slots", []))
        where = f"slots {slots}" if slots else f"whole node (MAAS {p.get('maas_system_id')})"
        return f"placed on [bold]{p.get('node_id')}[/]: {where}"
    if kind == "provisioning":
        what = f"task {p['task_id']}" if p.get("task_id") else f"MAAS operation {p.get('operation_id')}"
        return f"provisioning on {p.get('node_id')} ({what})"
    if kind == "active":
        a = p.get("access", {})
        bits = [
            f"ip {a['ip']}" if a.get("ip") else None,
            "ssh ready" if a.get("ssh_ready") else None,
            f"MAAS {a['maas_system_id']}" if a.get("maas_system_id") else None,
        ]
        return f"[green]active[/] on {p.get('node_id')}: " + ", ".join(b for b in bits if b)
    if kind == "releasing":
        return "releasing" + (f": {p['reason']}" if p.get("reason") else "")
    if kind == "released":
        c = p.get("cleanup", {})
        proof = f"{len(c.get('wipe_proofs', []))} wipe proof(s)" if c.get("wipe_proofs") else "no wipe needed"
        return f"[green]released[/]: cleanup verified={c.get('verified')}, {proof}"
    if kind in ("rejected", "unschedulable", "failed"):
        extra = f" (free GPUs {p.get('free_gpus')}, asked {p.get('requested_gpus')})" if kind == "unschedulable" else ""
        return f"[red]{kind}[/]: {p.get('reason_code')}: {p.get('reason')}{extra}"
    return kind


async def _follow(
    nc,
    allocation_id: str,
    start: Any,
    goal: set[str],
    fail: set[str],
    timeout: float,
    initial: str,
    progress: bool = False,
) -> dict[str, Any]:
    """Subscribe first, then publish (`start`), then print events for one allocation until an end state.

    `progress` adds the agents' task phases, which only identities that read reports may see (not a portal)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg) -> None:
        await queue.put(msg)

    subs = [await nc.subscribe(ALLOCATION_EVENTS, cb=on_msg)]
    if progress:
        subs.append(await nc.subscribe(TASK_PROGRESS, cb=on_msg))
    await nc.flush()  # the server knows our interest before the request can cause any event
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "allocation_id": allocation_id,
        "state": initial,
        "node_id": None,
        "timed_out": False,
        "timeline": [{"state": initial, "at": _now_iso(), "elapsed_s": 0.0}],
    }
    await start()
    err.print(f"[dim]+0.00s[/] {initial} [bold]{allocation_id}[/]")
    deadline = t0 + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result["timed_out"] = True
                err.print(f"[red]timed out after {timeout:.0f}s[/] in state {result['state']}")
                return result
            try:
                msg = await asyncio.wait_for(queue.get(), remaining)
            except asyncio.TimeoutError:
                continue
            try:
                data = json.loads(msg.data)
                payload = data["payload"]
                type_ = data["type"]
            except (ValueError, KeyError, TypeError):
                continue
            if str(payload.get("allocation_id")) != allocation_id:
                continue
            elapsed = time.monotonic() - t0
            if type_ == "node.task_progress":
                detail = f" — {payload['detail']}" if payload.get("detail") else ""
                err.print(
                    f"[dim]+{elapsed:.2f}s[/]   · {payload.get('node_id')} {payload.get('task_type')}: "
                    f"{payload.get('phase')}{detail}"
                )
                continue
            if not type_.startswith("allocation."):
                continue
            state = type_.split(".", 1)[1]
            result["state"] = state
            result["node_id"] = payload.get("node_id") or result["node_id"]
            result["timeline"].append({"state": state, "at": data.get("occurred_at"), "elapsed_s": round(elapsed, 3)})
            for key in ("reason_code", "reason", "access", "cleanup"):
                if payload.get(key) is not None:
                    result[key] = payload[key]
            err.print(f"[dim]+{elapsed:.2f}s[/] {_describe_event(state, payload)}")
            if state in goal or state in fail:
                return result
    finally:
        for sub in subs:
            await sub.unsubscribe()


def _finish(result: dict[str, Any], goal: set[str], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    raise typer.Exit(0 if result["state"] in goal and not result.get("timed_out") else 1)


# --- portal commands ------------------------------------------------------------------------------------


@app.command()
def allocate(
    shape: Annotated[str, typer.Option("--shape", help="gpu_slice or baremetal.")],
    gpus: Annotated[
        Optional[int], typer.Option("--gpus", help="GPU count (default 1 for a slice, 8 for baremetal).")
    ] = None,
    image: Annotated[Optional[str], typer.Option("--image", help="Image slug (default per shape).")] = None,
    tenant: Annotated[str, typer.Option("--tenant")] = "dev",
    region: Annotated[str, typer.Option("--region")] = "default",
    ssh_key: Annotated[
        Optional[list[str]],
        typer.Option("--ssh-key", help="Public key text or .pub file (repeatable; default: ~/.ssh/id_*.pub)."),
    ] = None,
    hostname: Annotated[Optional[str], typer.Option("--hostname")] = None,
    allocation_id: Annotated[
        Optional[str], typer.Option("--allocation-id", help="Idempotency key (default: new UUID).")
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the lifecycle until active or a failure.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait with --wait.")] = 180.0,
    as_json: JsonOpt = False,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Publish allocation.requested; with --wait follow it to active (exit 0) or a failure (exit 1)."""
    from pydantic import ValidationError

    from gpuaas_common.contract.messages import AllocationRequested

    if shape not in DEFAULTS:
        raise typer.BadParameter("must be gpu_slice or baremetal", param_hint="--shape")
    d = DEFAULTS[shape]
    try:
        request = AllocationRequested(
            allocation_id=uuid.UUID(allocation_id) if allocation_id else uuid.uuid4(),
            tenant_id=tenant,
            shape=shape,
            sku=d["sku"],
            gpu_count=gpus or d["gpus"],
            image=image or d["image"],
            region=region,
            ssh_public_keys=_ssh_keys(ssh_key),
            hostname=hostname,
        )
    except (ValidationError, ValueError) as exc:
        err.print(f"[red]invalid request[/]: {exc}")
        raise typer.Exit(2) from None
    url = _resolve_nats_url(nats_url, run_dir)
    _publish_and_follow(
        _identity(url, creds, run_dir, "portal"),
        "allocation.requested",
        request,
        wait=wait,
        timeout=timeout,
        initial="requested",
        said="requested",
        success={"active"},
        failure={"rejected", "unschedulable", "failed", "releasing", "released"},
        as_json=as_json,
    )


@app.command()
def release(
    allocation_id: Annotated[str, typer.Argument(help="The allocation to release.")],
    reason: Annotated[Optional[str], typer.Option("--reason")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow until released (exit 0) or failed (exit 1).")] = False,
    timeout: Annotated[float, typer.Option("--timeout")] = 180.0,
    as_json: JsonOpt = False,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Publish allocation.release_requested; with --wait follow it to released."""
    from gpuaas_common.contract.messages import AllocationReleaseRequested

    try:
        request = AllocationReleaseRequested(allocation_id=uuid.UUID(allocation_id), reason=reason)
    except ValueError as exc:
        err.print(f"[red]invalid allocation id[/]: {exc}")
        raise typer.Exit(2) from None
    url = _resolve_nats_url(nats_url, run_dir)
    _publish_and_follow(
        _identity(url, creds, run_dir, "portal"),
        "allocation.release_requested",
        request,
        wait=wait,
        timeout=timeout,
        initial="release_requested",
        said="release requested for",
        success={"released"},
        failure={"failed", "rejected"},
        as_json=as_json,
    )


def _publish_and_follow(
    identity: Any,
    type_: str,
    request: Any,
    *,
    wait: bool,
    timeout: float,
    initial: str,
    said: str,
    success: set[str],
    failure: set[str],
    as_json: bool,
) -> None:
    """Publish a portal message; with `wait`, follow the allocation until a success or failure state."""
    alloc = str(request.allocation_id)

    async def run() -> dict[str, Any]:
        nc = await _connect(identity)
        js = nc.jetstream()
        try:

            async def publish() -> None:
                await _publish(js, type_, request.model_dump(mode="json"), alloc)

            if not wait:
                await publish()
                err.print(f"{said} [bold]{alloc}[/]")
                return {
                    "allocation_id": alloc,
                    "state": initial,
                    "node_id": None,
                    "timed_out": False,
                    "timeline": [{"state": initial, "at": _now_iso(), "elapsed_s": 0.0}],
                }
            return await _follow(
                nc,
                alloc,
                publish,
                success,
                failure,
                timeout,
                initial,
                progress=identity.name in ("ops", "admin", "anonymous"),
            )
        finally:
            await nc.drain()

    result = asyncio.run(run())
    _finish(result, success | {initial} if not wait else success, as_json)


@events_app.command("tail")
def events_tail(
    subject: Annotated[str, typer.Option("--subject", help="NATS subject (wildcards allowed).")] = ALLOCATION_EVENTS,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line on stdout.")] = False,
    count: Annotated[int, typer.Option("--count", help="Stop after this many messages (0: never).")] = 0,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Follow messages as they are published (new ones only) until Ctrl-C."""
    url = _resolve_nats_url(nats_url, run_dir)
    identity = _identity(url, creds, run_dir, "ops")

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def on_closed() -> None:
            await queue.put(None)  # the stack went away: stop instead of waiting forever

        nc = await _connect(identity, closed_cb=on_closed)

        async def on_msg(msg) -> None:
            await queue.put(msg)

        await nc.subscribe(subject, cb=on_msg)
        await nc.flush()
        err.print(f"[dim]following {subject} on {url} (Ctrl-C to stop)[/]")
        seen = 0
        try:
            while count == 0 or seen < count:
                msg = await queue.get()
                if msg is None:
                    err.print("[yellow]connection to NATS closed[/]")
                    return
                seen += 1
                try:
                    data = json.loads(msg.data)
                except ValueError:
                    data = {"raw": msg.data.decode("utf-8", "replace")}
                if as_json:
                    typer.echo(json.dumps({"subject": msg.subject, **data}, default=str), nl=True)
                    continue
                payload = data.get("payload", {}) if isinstance(data, dict) else {}
                kind = str(data.get("type", "?"))
                summary = (
                    _describe_event(kind.split(".", 1)[1], payload)
                    if kind.startswith("allocation.")
                    else json.dumps(payload, default=str)[:200]
                )
                err.print(
                    f"[dim]{data.get('occurred_at', '')}[/] [cyan]{kind}[/] "
                    f"{payload.get('allocation_id', '')} {summary}"
                )
        finally:
            if not nc.is_closed:
                await nc.drain()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


# --- MAAS simulator ----------------------------------------------------------------------------------------


@app.command("maas-sim")
def maas_sim(
    api_key: Annotated[
        str,
        typer.Option(
            "--api-key",
            envvar="GPUAAS_MAAS_API_KEY",
            show_default=False,
            help="The one key MAAS accepts (consumer:token:secret).",
        ),
    ],
    port: Annotated[int, typer.Option("--port", help="0 picks a free port.")] = 5240,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    machines: Annotated[Optional[int], typer.Option("--machines", help="Machine count (hostnames bm-01…).")] = None,
    machines_file: Annotated[
        Optional[Path],
        typer.Option("--machines-file", exists=True, dir_okay=False, help="JSON list of {system_id, hostname, tags}."),
    ] = None,
    deploy_seconds: Annotated[Optional[float], typer.Option("--deploy-seconds")] = None,
    release_seconds: Annotated[Optional[float], typer.Option("--release-seconds")] = None,
    erase_seconds: Annotated[Optional[float], typer.Option("--erase-seconds")] = None,
    commission_seconds: Annotated[Optional[float], typer.Option("--commission-seconds")] = None,
    testing_seconds: Annotated[Optional[float], typer.Option("--testing-seconds")] = None,
    custom_image: Annotated[
        Optional[list[str]], typer.Option("--custom-image", help="Uploaded custom image name (repeatable).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    ready_file: Annotated[
        Optional[Path], typer.Option("--ready-file", help="Written as JSON {service, pid, port} once serving.")
    ] = None,
) -> None:
    """Serve the MAAS 2.0 API simulator until SIGTERM/Ctrl-C."""
    from gpuaas_dev.maas_sim import SimConfig
    from gpuaas_dev.maas_sim import server as sim_server

    if machines is not None and machines_file is not None:
        raise typer.BadParameter("give --machines or --machines-file, not both")
    try:
        config = SimConfig.from_cli(
            machines=machines if machines is not None else 4,
            api_key=api_key,
            machines_file=machines_file,
            deploy_seconds=deploy_seconds,
            release_seconds=release_seconds,
            erase_seconds=erase_seconds,
            commission_seconds=commission_seconds,
            testing_seconds=testing_seconds,
            seed=seed,
            custom_images=custom_image or None,
        )
    except ValueError as exc:
        err.print(f"[red]invalid simulator configuration[/]: {exc}")
        raise typer.Exit(2) from None

    async def serve() -> None:
        runner, actual = await sim_server.start(config, host, port)
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"service": "maas-sim", "pid": os.getpid(), "port": actual}))
            tmp.replace(ready_file)
        err.print(f"MAAS simulator at http://{host}:{actual}/MAAS/")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())


# --- contract ------------------------------------------------------------------------------------------------


@contract_app.command("render")
def contract_render(
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 if the committed file differs; write nothing.")
    ] = False,
) -> None:
    """Render contracts/asyncapi.yaml from the contract models."""
    from gpuaas_common.contract.asyncapi import CONTRACT_PATH, render_yaml

    if not (CONTRACT_PATH.parents[1] / "pyproject.toml").exists():
        err.print("[red]run this from a source checkout[/] (an editable install): the contract lives in the repo")
        raise typer.Exit(2)
    rendered = render_yaml()
    current = CONTRACT_PATH.read_text() if CONTRACT_PATH.exists() else None
    if check:
        if current != rendered:
            err.print(f"[red]{CONTRACT_PATH.name} drifted from the contract models[/]; run `make contract`")
            raise typer.Exit(1)
        err.print(f"{CONTRACT_PATH.name} is up to date")
        return
    if current == rendered:
        err.print(f"{CONTRACT_PATH.name} unchanged")
        return
    CONTRACT_PATH.parent.mkdir(parents=True, exist_ok=True)
    CONTRACT_PATH.write_text(rendered)
    err.print(f"wrote {CONTRACT_PATH}")


# --- dev stack -----------------------------------------------------------------------------------------------


class _Shutdown(BaseException):
    """Raised from a signal handler so a stack that is still starting unwinds and stops what it started."""


def _raise_shutdown(signum, _frame) -> None:
    raise _Shutdown(signum)


def _print_summary(info: dict[str, Any]) -> None:
    table = Table(title=f"gpuaas dev stack ({info.get('status')})", show_lines=False)
    table.add_column("process")
    table.add_column("pid", justify="right")
    table.add_column("port", justify="right")
    table.add_column("log")
    for name, s in info.get("services", {}).items():
        table.add_row(
            name, str(s.get("pid") or "-"), str(s.get("health_port") or s.get("port") or "-"), s.get("log", "")
        )
    err.print(table)
    err.print(f"NATS      {info.get('nats_url')}")
    err.print(f"Postgres  {info.get('database_url')}")
    err.print(f"MAAS sim  {info.get('maas_url')}")
    err.print(f"run dir   {info.get('run_dir')} (stack.json, logs/)")


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


def _stack_args(slice_hosts: int, slots: int, baremetal: int) -> dict[str, int]:
    return {"slice_hosts": slice_hosts, "slots_per_host": slots, "baremetal_hosts": baremetal}


SliceHostsOpt = Annotated[int, typer.Option("--slice-hosts", min=0)]
SlotsOpt = Annotated[int, typer.Option("--slots", min=1, max=8, help="Slots (GPUs) per slice host.")]
BaremetalOpt = Annotated[int, typer.Option("--baremetal", min=0, help="Baremetal machines in MAAS.")]
LogLevelOpt = Annotated[str, typer.Option("--log-level")]


@dev_app.command("up")
def dev_up(
    detach: Annotated[bool, typer.Option("--detach", help="Leave a supervisor running in the background.")] = False,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    slice_hosts: SliceHostsOpt = 4,
    slots: SlotsOpt = 8,
    baremetal: BaremetalOpt = 2,
    log_level: LogLevelOpt = "INFO",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the stack to be ready.")] = 180.0,
) -> None:
    """Start NATS, Postgres, the MAAS simulator and the five services; return once all are ready."""
    from gpuaas_dev.stack import Stack

    run_dir = run_dir.resolve()
    info = _read_stack_json(run_dir)
    if info and info.get("status") in ("starting", "ready") and _pid_is_ours(info.get("supervisor_pid")):
        err.print(
            f"[red]a stack is already running in {run_dir}[/] (supervisor pid {info['supervisor_pid']}); "
            f"`gpuaas dev down --run-dir {run_dir}` first"
        )
        raise typer.Exit(1)
    if not detach:
        stack = Stack(run_dir, log_level=log_level, **_stack_args(slice_hosts, slots, baremetal))
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
    ]
    with log_path.open("ab") as log:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=Path.cwd()
        )
    err.print(f"supervisor pid {child.pid}; waiting for the stack (log: {log_path})")
    from gpuaas_dev.stack import tail

    deadline = time.monotonic() + timeout
    while True:
        code = child.poll()
        if code is not None:
            err.print(f"[red]the supervisor exited with code {code}[/]; last lines of {log_path}:\n{tail(log_path)}")
            raise typer.Exit(1)
        info = _read_stack_json(run_dir)
        if info and info.get("status") == "ready" and info.get("supervisor_pid") == child.pid:
            _print_summary(info)
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
) -> None:
    """The detached supervisor behind `dev up --detach`."""
    from gpuaas_dev.stack import Stack

    stack = Stack(run_dir.resolve(), log_level=log_level, **_stack_args(slice_hosts, slots, baremetal))
    raise typer.Exit(_supervise(stack, announce=False))


@dev_app.command("down")
def dev_down(
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for a clean stop.")] = 60.0,
) -> None:
    """Stop the stack started by `dev up` in this run dir (SIGTERM to its supervisor)."""
    run_dir = run_dir.resolve()
    info = _read_stack_json(run_dir)
    if info is None:
        err.print(f"no stack in {run_dir}")
        return
    pid = info.get("supervisor_pid")
    if not _pid_is_ours(pid):
        _stop_leftovers(info)
        err.print(f"no stack running in {run_dir}")
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _pid_alive(pid):
        err.print(f"[yellow]supervisor {pid} did not stop within {timeout:.0f}s; killing it and its services[/]")
        os.kill(pid, signal.SIGKILL)
        _stop_leftovers(info)
    err.print(f"stack in {run_dir} stopped")


def _stop_leftovers(info: dict[str, Any]) -> None:
    """Last resort when the supervisor is gone: the service PIDs it recorded, if they are still gpuaas."""
    pids = [s.get("pid") for s in info.get("services", {}).values()] + [info.get("nats_pid")]
    for pid in pids:
        if _pid_is_ours(pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


@dev_app.command("status")
def dev_status(run_dir: RunDirOpt = DEFAULT_RUN_DIR, as_json: JsonOpt = False) -> None:
    """Show the stack's processes and whether each answers /readyz."""
    run_dir = run_dir.resolve()
    info = _read_stack_json(run_dir)
    if info is None:
        err.print(f"no stack in {run_dir}")
        raise typer.Exit(1)
    running = _pid_is_ours(info.get("supervisor_pid")) and info.get("status") in ("starting", "ready")
    rows = {}
    for name, s in info.get("services", {}).items():
        port = s.get("health_port") or s.get("port")
        path = "/_sim/healthz" if name == "maas-sim" else "/readyz"
        ready = False
        if running and port and _pid_alive(s.get("pid")):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
                    ready = resp.status == 200
            except (urllib.error.URLError, OSError):
                ready = False
        rows[name] = {"pid": s.get("pid"), "port": port, "ready": ready, "restarts": s.get("restarts", 0)}
    summary = {
        "running": running,
        "status": info.get("status") if running else "stopped",
        "nats_url": info.get("nats_url"),
        "maas_url": info.get("maas_url"),
        "services": rows,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        table = Table(title=f"gpuaas dev stack in {run_dir}: {summary['status']}")
        for col in ("process", "pid", "port", "ready", "restarts"):
            table.add_column(col)
        for name, r in rows.items():
            table.add_row(
                name,
                str(r["pid"] or "-"),
                str(r["port"] or "-"),
                "[green]yes[/]" if r["ready"] else "[red]no[/]",
                str(r["restarts"]),
            )
        err.print(table)
    raise typer.Exit(0 if running and all(r["ready"] for r in rows.values()) else 1)


@dev_app.command("fleet")
def dev_fleet(
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Directory for fleet.json, maas-machines.json, images/.")],
    slice_hosts: SliceHostsOpt = 4,
    slots: SlotsOpt = 8,
    baremetal: BaremetalOpt = 2,
    ssh_port: Annotated[int, typer.Option("--ssh-port", help="Port the simulated guests answer SSH on.")] = 2222,
) -> None:
    """Write a simulated fleet, its MAAS machine list and the seed images (used by docker-compose)."""
    from gpuaas_dev.stack import prepare_fleet_dir

    files = prepare_fleet_dir(
        out_dir, slice_hosts=slice_hosts, slots_per_host=slots, baremetal_hosts=baremetal, ssh_port=ssh_port
    )
    for kind, path in files.items():
        err.print(f"{kind:9} {path}")


@dev_app.command("maas-key")
def dev_maas_key() -> None:
    """Print a fresh MAAS-shaped API key (for GPUAAS_MAAS_API_KEY in docker-compose)."""
    from gpuaas_dev.maas_sim import generate_api_key

    typer.echo(str(generate_api_key()))


# --- Postgres roles (docker-compose's init step) --------------------------------------------------------------

from .pg_roles_cli import pg_roles as _pg_roles  # noqa: E402

dev_app.command("pg-roles")(_pg_roles)


def main() -> None:
    from gpuaas_common.logging import configure_logging

    # Library logs (stream provisioning, the simulator) go to stderr so `--json` output stays parseable.
    configure_logging("gpuaas-cli", os.environ.get("GPUAAS_LOG_LEVEL", "WARNING").upper())
    app()


if __name__ == "__main__":
    main()
