"""Talking to the bus from a command line: which NATS, as whom, connecting, publishing, describing events."""

import os
from pathlib import Path
from typing import Any, Optional

from gpuaas_common.contract import AllocationState
from gpuaas_common.natsconn import split_servers

from ..identity_cli import cli_identity
from .common import (
    EXIT_FAILED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    err,
    fail,
    no_stack,
    pid_alive,
    read_stack_json,
    refused,
    unreachable,
)

ALLOCATION_EVENTS = "gpuaas.allocation.event.>"
TASK_PROGRESS = "gpuaas.node.*.report.task_progress"


def resolve_nats_url(nats_url: Optional[str], run_dir: Path) -> str:
    if nats_url:
        return nats_url
    if os.environ.get("GPUAAS_NATS_URL"):
        return os.environ["GPUAAS_NATS_URL"]
    info = read_stack_json(run_dir)
    if info and info.get("nats_url") and info.get("status") == "ready" and pid_alive(info.get("supervisor_pid")):
        return info["nats_url"]
    raise no_stack("NATS URL", run_dir, "pass --nats-url or set $GPUAAS_NATS_URL")


def bus_identity(url: str, creds: Optional[Path], run_dir: Path, role: str):
    from gpuaas_common.natsconn import InsecureTransport

    bad = [s for s in split_servers(url) if not s.startswith(("nats://", "tls://"))]
    if bad:
        raise fail(f"[red]bad NATS URL {bad[0]!r}[/]: expected nats://host:port or tls://host:port", EXIT_UNREACHABLE)
    try:
        return cli_identity(url, creds, run_dir, role)
    except FileNotFoundError as exc:
        raise fail(f"[red]{exc}[/]", EXIT_UNREACHABLE) from None
    except InsecureTransport as exc:
        raise fail(f"[red]refused to connect[/]: {exc}", EXIT_USAGE) from None


async def connect(identity, closed_cb=None):
    import nats

    extra = {"closed_cb": closed_cb} if closed_cb else {}
    seen: list[BaseException] = []

    async def error_cb(exc: Exception) -> None:
        # nats-py's default logs every failed attempt with its traceback; the one-line message below
        # (or the command's own) says all a user needs.
        seen.append(exc)

    try:
        return await nats.connect(
            **identity.connect_kwargs(),
            connect_timeout=3,
            max_reconnect_attempts=2,
            reconnect_time_wait=0.5,
            name="gpuaas-cli",
            error_cb=error_cb,
            **extra,
        )
    except Exception as exc:  # nats-py raises several unrelated types for "nobody there"
        first = seen[0] if seen else exc
        reason = str(first) or type(first).__name__
        where = ", ".join(identity.servers)
        if "authorization" in reason.lower() or "authentication" in reason.lower():
            raise refused(f"NATS at {where}", f"{identity.name}: {reason}") from None
        raise unreachable("NATS", f"{where} as {identity.name}", reason) from None


async def publish_event(js, type_: str, payload: dict[str, Any], correlation_id: str) -> str:
    from gpuaas_common.contract import Envelope, spec_for

    # No provisioning here: streams belong to the admin identity, and a portal or an operator's laptop
    # must not be able to create or change them. A missing stream shows up as "no stream acknowledged".
    env = Envelope.wrap(type_, payload, producer="gpuaas-cli", correlation_id=correlation_id)
    subject = spec_for(type_).subject()
    import nats.errors
    import nats.js.errors

    try:
        ack = await js.publish(subject, env.model_dump_json().encode(), headers={"Nats-Msg-Id": env.event_id})
    except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
        raise fail(
            f"[red]{subject}: no stream takes this subject[/] (streams are provisioned by the admin identity, "
            "e.g. `gpuaas dev up`)",
            EXIT_FAILED,
        ) from None
    except nats.errors.TimeoutError:
        raise fail(f"[red]{subject}: JetStream did not acknowledge the message in time[/]", EXIT_TIMEOUT) from None
    except nats.errors.Error as exc:
        raise fail(f"[red]{subject}: publish refused[/]: {exc}", EXIT_FAILED) from None
    if not ack.stream:
        raise fail(f"[red]{subject}: no stream acknowledged the message[/]", EXIT_FAILED)
    if ack.duplicate:
        err.print(f"[yellow]{subject}: JetStream reports a duplicate of event {env.event_id}[/]")
    return env.event_id


def describe_event(kind: str, payload: dict[str, Any]) -> str:
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
            f"user {a['user']}" if a.get("user") else None,
            "ssh ready" if a.get("ssh_ready") else None,
            f"MAAS {a['maas_system_id']}" if a.get("maas_system_id") else None,
        ]
        return f"[green]active[/] on {p.get('node_id')}: " + ", ".join(b for b in bits if b)
    if kind == "releasing":
        return "releasing" + (f": {p['reason']}" if p.get("reason") else "")
    if kind == "released":
        c = p.get("cleanup", {})
        # A MAAS release (erased per the site profile) or an early one says what it was in `reason`.
        proof = (
            f"{len(c.get('wipe_proofs', []))} wipe proof(s)"
            if c.get("wipe_proofs")
            else (c.get("reason") or "no wipe needed")
        )
        checked = {True: "cleanup verified", False: "[yellow]cleanup not verified[/]"}.get(c.get("verified"), "cleanup")
        return f"[green]released[/]: {checked}, {proof}"
    if kind == "release_rejected":
        color = "yellow" if p.get("reason_code") == "already_releasing" else "red"
        state = f" (state {p['state']})" if p.get("state") else ""
        return f"[{color}]release rejected[/]: {p.get('reason_code')}: {p.get('reason')}{state}"
    if kind in ("rejected", AllocationState.UNSCHEDULABLE, AllocationState.FAILED):
        # Free GPUs say why there was no room; a quota refusal already says what the tenant holds and asked.
        room = kind == "unschedulable" and p.get("reason_code") != "quota_exceeded"
        extra = f" (free GPUs {p.get('free_gpus')}, asked {p.get('requested_gpus')})" if room else ""
        return f"[red]{kind}[/]: {p.get('reason_code')}: {p.get('reason')}{extra}"
    return kind
