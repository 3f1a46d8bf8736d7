"""Admin actions over the scheduler's admin API: `gpuaas nodes|slots|quota|wipe-policy …`,
`gpuaas allocations force-release` and `gpuaas api docs`. Reads print with `-o`; changes print the object as
the API answers it after the change."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from gpuaas_common.contract import HostMode, SlotStatus, WipePolicy

from .admin_api import (
    ActorOpt,
    AdminUrlOpt,
    ApiTimeoutOpt,
    IdempotencyOpt,
    ReasonOpt,
    TokenOpt,
    actor_name,
    call,
    endpoint,
    quote,
)
from .common import DEFAULT_RUN_DIR, EXIT_FAILED, EXIT_USAGE, RunDirOpt, bad_id, err, fail, read_stack_json
from .output import Column, IntervalOpt, OutputOpt, WatchOpt, age, age_of, choices, emit, render, watch

nodes_app = typer.Typer(
    no_args_is_help=True,
    help="Nodes: list, show, drain, undrain, host mode, rediscover, parity, commission (admin API).",
)
slots_app = typer.Typer(no_args_is_help=True, help="Slots: list, show, approve, repair, disable (admin API).")
quota_app = typer.Typer(no_args_is_help=True, help="Tenant GPU quotas (admin API).")
wipe_policy_app = typer.Typer(no_args_is_help=True, help="A site's destructive wipe policy (admin API).")
api_app = typer.Typer(no_args_is_help=True, help="The admin HTTP APIs themselves.")

WIPE_POLICIES = tuple(p.value for p in WipePolicy)
MODES = tuple(m.value for m in HostMode)
WipePolicy = choices("WipePolicy", WIPE_POLICIES)
Mode = choices("Mode", MODES)
# The statuses a slot can have, as the contract carries them (scheduler.slots_changed).
SLOT_STATUSES: tuple[str, ...] = tuple(s.value for s in SlotStatus)

NodeArg = Annotated[str, typer.Argument(help="The node's id (`gpuaas nodes list`).")]
SlotArg = Annotated[str, typer.Argument(help="The slot's id (`gpuaas slots list`).")]


def _ep(admin_url, token, run_dir, timeout):
    return endpoint(admin_url, token, run_dir, timeout)


def _read(fetch, show, output: str, watching: bool, interval: float) -> None:
    if watching:
        watch(fetch, lambda doc, compact: show(doc, compact), interval)
    else:
        typer.echo(show(fetch(), False))


# --- nodes -----------------------------------------------------------------------------------------------------

NODE_COLUMNS: list[Column] = [
    "node_id",
    "kind",
    "mode",
    "schedulable",
    "draining",
    ("SLOTS", lambda n: f"{n.get('free_slots')}/{n.get('total_slots')}" if n.get("total_slots") else "-"),
    ("UPDATED", lambda n: age(n.get("updated_at"))),
]
NODE_WIDE: list[Column] = ["region", "sku", "gpu_count", "maintenance", "parity_failures", "drain_reason"]


def _node_fields(node: dict[str, Any]) -> list[Column]:
    return [
        "node_id",
        "kind",
        "hostname",
        "region",
        "sku",
        "mode",
        "schedulable",
        "draining",
        "drain_reason",
        "maintenance",
        ("slots", lambda n: f"{n.get('free_slots')} free of {n.get('total_slots')}"),
        "parity_failures",
        ("updated", lambda n: f"{n.get('updated_at')} ({age(n.get('updated_at'))} ago)"),
    ]


def _node_detail_text(doc: dict[str, Any], output: str, compact: bool) -> str:
    if output in ("json", "yaml"):
        return render(doc, output, compact=compact)
    node = doc["node"]
    claims: Column = ("live claims", lambda _: len(doc.get("live_claims") or []))
    wide: list[Column] = ["pool", "maas_system_id", "maas_tags"]
    lines = [render(node, output, fields=[*_node_fields(node), claims], wide=wide)]
    history = doc.get("mode_history") or []
    if history:
        lines.append("mode history")
        for h in history:
            lines.append(
                f"  {h.get('at')} {h.get('from_mode') or '-'} -> {h.get('to_mode')} by {h.get('actor')}: "
                f"{h.get('reason')}"
            )
    asks = doc.get("actions") or []
    if asks:
        # What was asked of the host (rediscovery, parity, commissioning) and what its report found.
        lines.append("asks")
        for a in asks:
            lines.append(
                f"  {a.get('requested_at')} {a.get('kind')} {a.get('status')} by {a.get('actor')}: {a.get('reason')}"
                + (f" -> {a.get('outcome')}" if a.get("outcome") else "")
            )
    walks = doc.get("walks") or []
    if walks:
        # A converting host's way back to slice mode, newest first: where it stands, or why it stopped.
        lines.append("walks back to slice mode")
        for w in walks:
            lines.append(f"  {w.get('started_at')} {w.get('walk_id')} {w.get('state')}: {w.get('reason')}")
            for st in w.get("steps") or []:
                lines.append(
                    f"    {st.get('at')} {st.get('from_state') or '-'} -> {st.get('to_state')}: {st.get('reason')}"
                )
    if doc.get("wipe_task"):
        # An undrain out of maintenance: these slots are placed nowhere until the host proves the wipe.
        lines.append(f"wipe asked of the host: task {doc['wipe_task']}")
        lines.append(f"  awaiting_wipe: {', '.join(doc.get('awaiting_wipe') or []) or '-'}")
        lines.append(f"  asked: {', '.join(doc.get('wipe_asked') or [])}")
    waivers = doc.get("waivers") or []
    if waivers:
        # Approval went, or may go, past a failing gate on these: who, why and until when stay in view.
        lines.append("approval gate waivers")
        for w in waivers:
            state = "active" if w.get("active") else "expired"
            lines.append(
                f"  #{w.get('waiver_id')} {w.get('gate')} {state} until {w.get('expires_at')} by {w.get('actor')}: "
                f"{w.get('reason')}"
            )
    return "\n".join(lines)


@nodes_app.command("list")
def nodes_list(
    region: Annotated[Optional[str], typer.Option("--region", help="Only nodes in this region.")] = None,
    sku: Annotated[Optional[str], typer.Option("--sku", help="Only nodes of this SKU.")] = None,
    output: OutputOpt = "table",
    watching: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Every node: kind, host mode, whether it takes placements, free slots.

    Example: gpuaas nodes list -o wide --watch"""
    ep = _ep(admin_url, token, run_dir, timeout)

    def show(doc: dict[str, Any], compact: bool) -> str:
        return render(doc, output, rows=doc["nodes"], columns=NODE_COLUMNS, wide=NODE_WIDE, compact=compact)

    _read(lambda: call(ep, "GET", "/v1/nodes", query={"region": region, "sku": sku}), show, output, watching, interval)


@nodes_app.command("show")
def nodes_show(
    node_id: NodeArg,
    output: OutputOpt = "table",
    watching: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """One node, its live claims and its mode history (exit 1 if unknown).

    Example: gpuaas nodes show slice-01 -o yaml"""
    ep = _ep(admin_url, token, run_dir, timeout)
    _read(
        lambda: call(ep, "GET", f"/v1/nodes/{quote(node_id)}", missing=("node", node_id)),
        lambda doc, compact: _node_detail_text(doc, output, compact),
        output,
        watching,
        interval,
    )


@nodes_app.command("drain")
def nodes_drain(
    node_id: NodeArg,
    reason: ReasonOpt,
    maintenance: Annotated[
        bool, typer.Option("--maintenance", help="Also mark it in maintenance (out for repair, not just drained).")
    ] = False,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Stop new placements on a node; what runs there keeps running.

    Example: gpuaas nodes drain slice-01 --reason "PSU swap" --maintenance"""
    ep = _ep(admin_url, token, run_dir, timeout)
    body = {"actor": actor_name(actor), "reason": reason, "maintenance": maintenance}
    doc = call(ep, "POST", f"/v1/nodes/{quote(node_id)}/drain", body=body, key=idempotency_key,
               missing=("node", node_id))  # fmt: skip
    typer.echo(_node_detail_text(doc, output, False))


@nodes_app.command("undrain")
def nodes_undrain(
    node_id: NodeArg,
    reason: ReasonOpt,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Let a drained node take placements again; out of maintenance, its free slots first await the host's wipe proof.

    Example: gpuaas nodes undrain slice-01 --reason "PSU replaced" -o json"""
    ep = _ep(admin_url, token, run_dir, timeout)
    body = {"actor": actor_name(actor), "reason": reason}
    doc = call(ep, "POST", f"/v1/nodes/{quote(node_id)}/undrain", body=body, key=idempotency_key,
               missing=("node", node_id))  # fmt: skip
    typer.echo(_node_detail_text(doc, output, False))


def _ask(kind: str, node_id: str, reason: str, output: str, actor, idempotency_key, admin_url, token, timeout,
         run_dir) -> None:  # fmt: skip
    ep = _ep(admin_url, token, run_dir, timeout)
    body = {"actor": actor_name(actor), "reason": reason}
    doc = call(ep, "POST", f"/v1/nodes/{quote(node_id)}/{kind}", body=body, key=idempotency_key,
               missing=("node", node_id))  # fmt: skip
    if output in ("json", "yaml"):
        typer.echo(render(doc, output))
        return
    a = doc["action"]
    typer.echo(f"{a['kind']} {a['action_id']} asked of {node_id}, answer due by {a['deadline']}")
    typer.echo(f"follow it: gpuaas nodes show {node_id}")


@nodes_app.command("rediscover")
def nodes_rediscover(
    node_id: NodeArg,
    reason: ReasonOpt,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Ask the host's agent to rediscover its topology (and run parity); the reports close the ask on the node's
    history (exit 1 if refused: unknown node, no slice agent in its mode, one already open).

    Example: gpuaas nodes rediscover slice-01 --reason "back from baremetal" """
    _ask("rediscover", node_id, reason, output, actor, idempotency_key, admin_url, token, timeout, run_dir)


@nodes_app.command("parity")
def nodes_parity(
    node_id: NodeArg,
    reason: ReasonOpt,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Ask the host's agent for a parity run now; its report closes the ask on the node's history.

    Example: gpuaas nodes parity slice-01 --reason "after a BIOS update" """
    _ask("parity", node_id, reason, output, actor, idempotency_key, admin_url, token, timeout, run_dir)


@nodes_app.command("commission")
def nodes_commission(
    node_id: NodeArg,
    reason: ReasonOpt,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Commission the machine through MAAS with the slice preflight; the preflight report closes the ask (the host
    must have a MAAS machine, no live claims and take no placements: drain it first).

    Example: gpuaas nodes commission slice-01 --reason "firmware changed" """
    _ask("commission", node_id, reason, output, actor, idempotency_key, admin_url, token, timeout, run_dir)


def _mode_text(doc: dict[str, Any], output: str, compact: bool) -> str:
    if output in ("json", "yaml"):
        return render(doc, output, compact=compact)
    lines = [f"{'node':<6}{doc.get('node_id')}", f"{'mode':<6}{doc.get('mode')}", "transitions"]
    for target, blockers in (doc.get("transitions") or {}).items():
        lines.append(f"  -> {target}: " + ("allowed now" if not blockers else "blocked: " + "; ".join(blockers)))
    return "\n".join(lines)


@nodes_app.command("mode")
def nodes_mode(
    node_id: NodeArg,
    mode: Annotated[
        Optional[Mode],  # type: ignore[valid-type]
        typer.Argument(help="Change to this mode (omit it to see the mode and what blocks each)."),
    ] = None,
    reason: Annotated[Optional[str], typer.Option("--reason", help="Why (required to change the mode).")] = None,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """A node's host mode and what blocks each transition; with MODE, change it (guarded: exit 1 if blocked).

    Example: gpuaas nodes mode slice-01 drained --reason "convert to baremetal" -o yaml"""
    if mode is not None and not reason:
        raise fail("[red]missing --reason[/]: a mode change is audited with its reason", EXIT_USAGE)
    ep = _ep(admin_url, token, run_dir, timeout)
    path = f"/v1/nodes/{quote(node_id)}/mode"
    if mode is None:
        doc = call(ep, "GET", path, missing=("node", node_id))
    else:
        body = {"actor": actor_name(actor), "reason": reason, "mode": mode.value}
        doc = call(ep, "POST", path, body=body, key=idempotency_key, missing=("node", node_id))
    typer.echo(_mode_text(doc, output, False))


# --- slots -----------------------------------------------------------------------------------------------------

SLOT_COLUMNS: list[Column] = ["slot_id", "node_id", "status", "health_state", "profile", age_of("approved_at")]
SLOT_WIDE: list[Column] = ["destructive_wipe_policy", "generation", "mac", "private_ip", "status_reason"]


def _slot_text(doc: dict[str, Any], output: str, compact: bool) -> str:
    if output in ("json", "yaml"):
        return render(doc, output, compact=compact)
    slot = doc["slot"]
    fields: list[Column] = [
        "slot_id", "node_id", "status", "status_reason", "health_state", "profile", "gpu_pci_address",
        "nvme_by_id", "destructive_wipe_policy", "generation",
        ("approved", lambda s: f"{s.get('approved_at')} ({age(s.get('approved_at'))} ago) by {s.get('approved_by')}"),
    ]  # fmt: skip
    lines = [render(slot, output, fields=fields, wide=["mac", "private_ip", "fabric_vf_pci_address", "numa_node"])]
    transitions = doc.get("transitions") or []
    if transitions:
        lines.append("transitions")
        for t in transitions:
            lines.append(
                f"  {t.get('at')} {t.get('from_status') or '-'} -> {t.get('to_status')} by {t.get('actor')}: "
                f"{t.get('reason') or ''}"
            )
    return "\n".join(lines)


@slots_app.command("list")
def slots_list(
    node: Annotated[Optional[str], typer.Option("--node", help="Only this node's slots.")] = None,
    status: Annotated[
        Optional[str], typer.Option("--status", help=f"Only slots in this status: {', '.join(SLOT_STATUSES)}.")
    ] = None,
    output: OutputOpt = "table",
    watching: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Slots (one GPU each, with its disk and network), filtered by node and status.

    Example: gpuaas slots list --status cleanup_blocked -o wide"""
    ep = _ep(admin_url, token, run_dir, timeout)

    def show(doc: dict[str, Any], compact: bool) -> str:
        return render(doc, output, rows=doc["slots"], columns=SLOT_COLUMNS, wide=SLOT_WIDE, compact=compact)

    query = {"node_id": node, "status": status}
    _read(lambda: call(ep, "GET", "/v1/slots", query=query), show, output, watching, interval)


@slots_app.command("show")
def slots_show(
    slot_id: SlotArg,
    output: OutputOpt = "table",
    watching: WatchOpt = False,
    interval: IntervalOpt = 2.0,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """One slot and its status transitions (exit 1 if unknown).

    Example: gpuaas slots show slice-01-0000:18:00.0 -o json"""
    ep = _ep(admin_url, token, run_dir, timeout)
    _read(
        lambda: call(ep, "GET", f"/v1/slots/{quote(slot_id)}", missing=("slot", slot_id)),
        lambda doc, compact: _slot_text(doc, output, compact),
        output,
        watching,
        interval,
    )


@slots_app.command("approve")
def slots_approve(
    node_id: NodeArg,
    candidate: Annotated[
        Optional[list[str]], typer.Option("--candidate", help="Approve only this candidate (repeatable; default: all).")
    ] = None,
    wipe_policy: Annotated[
        Optional[WipePolicy],  # type: ignore[valid-type]
        typer.Option("--wipe-policy", help="The wipe between tenants (default: the site's, else blkdiscard)."),
    ] = None,
    reason: Annotated[Optional[str], typer.Option("--reason", help="Why, for the audit log.")] = None,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Turn a node's discovered candidates into slots; a candidate that breaks an approval rule is listed with its
    problems and makes the exit 1.

    Example: gpuaas slots approve slice-05 --candidate slice-05-0000:18:00.0 --reason "racked and checked" -o json"""
    ep = _ep(admin_url, token, run_dir, timeout)
    body: dict[str, Any] = {"actor": actor_name(actor), "reason": reason, "candidate_ids": candidate,
                            "destructive_wipe_policy": wipe_policy and wipe_policy.value}  # fmt: skip
    body = {k: v for k, v in body.items() if v is not None}
    doc = call(ep, "POST", f"/v1/nodes/{quote(node_id)}/candidates/approve", body=body, key=idempotency_key,
               missing=("node", node_id))  # fmt: skip
    results = doc.get("results") or []
    emit(doc, output, rows=results, columns=["candidate_id", "slot_id", "status", "problems"])
    if output in ("table", "wide"):
        blockers = doc.get("mode_blockers")
        err.print(f"node mode {doc.get('mode')}" + (f"; blocked: {'; '.join(blockers)}" if blockers else ""))
    if any(r.get("problems") for r in results):
        raise typer.Exit(EXIT_FAILED)


def _json_file(path: Optional[Path], option: str) -> Optional[dict[str, Any]]:
    if path is None:
        return None
    try:
        value = json.loads(path.read_text())
    except OSError as exc:
        raise fail(f"[red]invalid {option}[/]: {exc.strerror}: {path}", EXIT_USAGE) from None
    except ValueError as exc:
        raise fail(f"[red]invalid {option}[/]: {path} is not JSON ({exc})", EXIT_USAGE) from None
    if not isinstance(value, dict):
        raise fail(f"[red]invalid {option}[/]: {path} must hold a JSON object", EXIT_USAGE)
    return value


@slots_app.command("repair")
def slots_repair(
    slot_id: SlotArg,
    reason: ReasonOpt,
    nvme_evidence: Annotated[
        Optional[Path],
        typer.Option("--nvme-evidence", help="JSON file: {mounted, mounted_children, signatures, is_os_disk}."),
    ] = None,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Return a disabled or cleanup_blocked slot to service, if the approval rules hold now. A cleanup_blocked slot
    is not freed by anything typed here: the scheduler asks its host for the site's wipe, and the host's own proof
    frees it.

    Example: gpuaas slots repair slice-01-0000:18:00.0 --reason "NVMe replaced" -o yaml"""
    body: dict[str, Any] = {"actor": actor_name(actor), "reason": reason}
    evidence = _json_file(nvme_evidence, "--nvme-evidence")
    if evidence is not None:
        body["nvme_evidence"] = evidence
    ep = _ep(admin_url, token, run_dir, timeout)
    doc = call(ep, "POST", f"/v1/slots/{quote(slot_id)}/repair", body=body, key=idempotency_key,
               missing=("slot", slot_id))  # fmt: skip
    typer.echo(_slot_text(doc, output, False))


@slots_app.command("disable")
def slots_disable(
    slot_id: SlotArg,
    reason: ReasonOpt,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Take a slot out of placement (`slots repair` brings it back).

    Example: gpuaas slots disable slice-01-0000:18:00.0 --reason "GPU XID 79" -o yaml"""
    ep = _ep(admin_url, token, run_dir, timeout)
    body = {"actor": actor_name(actor), "reason": reason}
    doc = call(ep, "POST", f"/v1/slots/{quote(slot_id)}/disable", body=body, key=idempotency_key,
               missing=("slot", slot_id))  # fmt: skip
    typer.echo(_slot_text(doc, output, False))


# --- quota -----------------------------------------------------------------------------------------------------

TenantArg = Annotated[str, typer.Argument(help="The tenant's id.")]
QUOTA_FIELDS: list[Column] = [
    "tenant_id",
    ("max_gpus", lambda q: (q.get("quota") or {}).get("max_gpus", "unlimited (no quota set)")),
    "gpus_in_use",
]


@quota_app.command("get")
def quota_get(
    tenant_id: TenantArg,
    output: OutputOpt = "table",
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """A tenant's GPU quota and the GPUs it holds now.

    Example: gpuaas quota get tenant-a -o json"""
    ep = _ep(admin_url, token, run_dir, timeout)
    emit(call(ep, "GET", f"/v1/tenants/{quote(tenant_id)}/quota"), output, fields=QUOTA_FIELDS)


@quota_app.command("set")
def quota_set(
    tenant_id: TenantArg,
    max_gpus: Annotated[int, typer.Argument(min=0, max=1_000_000, help="GPUs the tenant may hold at once.")],
    reason: ReasonOpt,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Set a tenant's GPU quota (requests past it are rejected; what it holds is kept).

    Example: gpuaas quota set tenant-a 16 --reason "contract signed" -o json"""
    ep = _ep(admin_url, token, run_dir, timeout)
    body = {"actor": actor_name(actor), "reason": reason, "max_gpus": max_gpus}
    doc = call(ep, "PUT", f"/v1/tenants/{quote(tenant_id)}/quota", body=body, key=idempotency_key)
    emit(doc, output, fields=QUOTA_FIELDS)


# --- wipe policy -----------------------------------------------------------------------------------------------

RegionOpt = Annotated[str, typer.Option("--region", help="The site (region).")]
POLICY_FIELDS: list[Column] = [
    "region",
    ("policy", lambda d: (d.get("site_policy") or {}).get("destructive_wipe_policy", "none (each slot's own)")),
    ("set_by", lambda d: (d.get("site_policy") or {}).get("set_by")),
    ("reason", lambda d: (d.get("site_policy") or {}).get("reason")),
    ("updated", lambda d: (d.get("site_policy") or {}).get("updated_at")),
]
POLICY_WIDE: list[Column] = ["slots_updated", "slots_in_use"]


@wipe_policy_app.command("get")
def wipe_policy_get(
    region: RegionOpt = "default",
    output: OutputOpt = "table",
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """The destructive wipe a site requires between tenants (none: each slot's approved policy).

    Example: gpuaas wipe-policy get --region default"""
    ep = _ep(admin_url, token, run_dir, timeout)
    emit(call(ep, "GET", f"/v1/sites/{quote(region)}/wipe-policy"), output, fields=POLICY_FIELDS)


@wipe_policy_app.command("set")
def wipe_policy_set(
    policy: Annotated[WipePolicy, typer.Argument(help="The wipe every slot gets.")],  # type: ignore[valid-type]
    reason: ReasonOpt,
    region: RegionOpt = "default",
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Set a site's wipe policy: agents are told to use it, and a released slot is reused only with its proof.

    Example: gpuaas wipe-policy set nvme_format --reason "audit finding 12" -o wide"""
    ep = _ep(admin_url, token, run_dir, timeout)
    body = {"actor": actor_name(actor), "reason": reason, "destructive_wipe_policy": policy.value}
    doc = call(ep, "PUT", f"/v1/sites/{quote(region)}/wipe-policy", body=body, key=idempotency_key)
    emit(doc, output, fields=POLICY_FIELDS, wide=POLICY_WIDE)


# --- force-release ---------------------------------------------------------------------------------------------


def force_release(
    allocation_id: Annotated[str, typer.Argument(help="The allocation's UUID.")],
    reason: ReasonOpt,
    force: Annotated[
        bool, typer.Option("--force", help="Even though the scheduler's record says a VM may still hold the devices.")
    ] = False,
    output: OutputOpt = "table",
    actor: ActorOpt = None,
    idempotency_key: IdempotencyOpt = None,
    admin_url: AdminUrlOpt = None,
    token: TokenOpt = None,
    timeout: ApiTimeoutOpt = 10.0,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Free an allocation's claims at the scheduler (the allocator is told; its slots end cleanup_blocked).

    Example: gpuaas allocations force-release "$ID" --reason "host lost" --force"""
    try:
        alloc = uuid.UUID(allocation_id)
    except ValueError:
        raise bad_id("allocation", allocation_id) from None
    ep = _ep(admin_url, token, run_dir, timeout)
    body = {"actor": actor_name(actor), "reason": reason, "force": force}
    doc = call(ep, "POST", f"/v1/allocations/{alloc}/force-release", body=body, key=idempotency_key)
    emit(doc, output, fields=["allocation_id", "forced", "holders"])


# --- api docs --------------------------------------------------------------------------------------------------


def _openapi_file(package: str) -> Optional[str]:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).resolve().parents[1] / "openapi.yaml"
    return str(path) if path.is_file() else None


@api_app.command("docs")
def api_docs(output: OutputOpt = "table", run_dir: RunDirOpt = DEFAULT_RUN_DIR) -> None:
    """Where each admin API of the selected stack serves its docs: a page listing every route (DOCS-URL, open it in a
    browser) and the OpenAPI document itself (OPENAPI-URL, .json or .yaml; both need no token). -o wide adds the
    document's file in the source tree, which a test keeps equal to the served one.

    Example: gpuaas api docs -o json"""
    info = read_stack_json(run_dir) or {}
    rows = []
    for name, prefix, package in (
        ("scheduler", "scheduler", "gpuaas_scheduler"),
        ("image-pipeline", "image", "gpuaas_image_pipeline"),
    ):
        url = info.get(f"{prefix}_admin_url")
        base = url.rstrip("/") if url else None
        rows.append(
            {
                "api": name,
                "url": url,
                "docs_url": f"{base}/docs" if base else None,
                "openapi_url": f"{base}/openapi.json" if base else None,
                "openapi_file": _openapi_file(package),
            }
        )
    emit({"apis": rows}, output, rows=rows, columns=["api", "docs_url"], wide=["openapi_url", "openapi_file"])
    if not any(r["url"] for r in rows) and output in ("table", "wide"):
        err.print(f"no stack runs in {run_dir.absolute()}: no URLs (`gpuaas dev up --detach` starts one)")
