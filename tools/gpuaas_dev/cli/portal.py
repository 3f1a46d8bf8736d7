"""Portal commands: `gpuaas allocate` and `gpuaas release`, acting as the portal identity."""

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer

from gpuaas_common.contract import AllocationState as A
from gpuaas_common.contract import Shape

from .bus import bus_identity, resolve_nats_url
from .common import (
    DEFAULT_RUN_DIR,
    EXIT_USAGE,
    CredsOpt,
    JsonOpt,
    NatsUrlOpt,
    RunDirOpt,
    bad_id,
    fail,
    read_stack_json,
)
from .follow import publish_and_follow

DEFAULTS = {
    Shape.GPU_SLICE: {"sku": "h200-sxm-slice", "image": "ubuntu-24.04-h200-slice", "gpus": 1},
    Shape.BAREMETAL: {"sku": "h200-sxm", "image": "ubuntu-24.04-h200-host", "gpus": 8},
}

# Used when no --ssh-key is given and the developer has no key of their own: the simulated guests
# refuse to boot without one, and a dev VM is never reachable from outside the loopback fleet.
DEV_SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuaWFhcy1kZXYtb25seS1ub3QtYS1yZWFsLWtleQ gpuaas-dev"


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


def _one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors())
    return str(exc)


def _check_offer(shape: str, gpus: Optional[int]) -> int:
    """The GPU count to ask for, or a usage error naming the allowed values: refused before any publish."""
    from gpuaas_allocator.domain.model import allowed_gpu_counts, validate_offer

    sku = DEFAULTS[shape]["sku"]
    count = DEFAULTS[shape]["gpus"] if gpus is None else gpus
    if validate_offer(shape, sku, count) is not None:
        raise fail(
            f"[red]invalid --gpus[/]: {shape} ({sku}) takes {_either(allowed_gpu_counts(sku))} GPUs, not {count}",
            EXIT_USAGE,
        )
    return count


def _either(values: Sequence[object]) -> str:
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _lab_image(shape: str, run_dir: Path) -> Optional[str]:
    """On a stack started with --lab, slices go to the lab host's image (the only one it verified)."""
    stack = read_stack_json(run_dir) if shape == Shape.GPU_SLICE else None
    lab = (stack or {}).get("lab") or {}
    return (lab.get("image") or {}).get("slug")


def allocate(
    shape: Annotated[
        str, typer.Option("--shape", help="gpu_slice (a VM with whole GPUs) or baremetal (a whole host).")
    ],
    gpus: Annotated[
        Optional[int],
        typer.Option("--gpus", help="GPU count: 1, 2, 4 or 8 for gpu_slice (default 1); 8 for baremetal (default)."),
    ] = None,
    image: Annotated[
        Optional[str],
        typer.Option("--image", help="Image slug (default per shape; a lab stack's slices: its lab image)."),
    ] = None,
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant the allocation is billed to.")] = "dev",
    region: Annotated[str, typer.Option("--region", help="Region to place the allocation in.")] = "default",
    ssh_key: Annotated[
        Optional[list[str]],
        typer.Option("--ssh-key", help="Public key text or .pub file (repeatable; default: ~/.ssh/id_*.pub)."),
    ] = None,
    hostname: Annotated[Optional[str], typer.Option("--hostname", help="Guest hostname (slices).")] = None,
    allocation_id: Annotated[
        Optional[str], typer.Option("--allocation-id", help="Idempotency key (default: new UUID).")
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the lifecycle until active or a failure.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait with --wait.")] = 180.0,
    as_json: JsonOpt = False,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Publish allocation.requested; with --wait follow it to active (exit 0) or a failure (exit 1). Prints the
    allocation's id on stdout (--json: the outcome); bad arguments are refused (exit 2) before anything is published.

    Example: ID=$(gpuaas allocate --shape gpu_slice --gpus 2 --wait) && gpuaas allocations show "$ID" -o yaml"""
    from pydantic import ValidationError

    from gpuaas_common.contract.messages import AllocationRequested

    if shape not in DEFAULTS:
        raise fail(f"[red]invalid --shape[/]: {shape!r}; must be {_either(list(DEFAULTS))}", EXIT_USAGE)
    count = _check_offer(shape, gpus)
    d = DEFAULTS[shape]
    try:
        alloc = uuid.UUID(allocation_id) if allocation_id else uuid.uuid4()
    except ValueError:
        raise bad_id("allocation", allocation_id or "") from None
    try:
        request = AllocationRequested(
            allocation_id=alloc,
            tenant_id=tenant,
            shape=shape,
            sku=d["sku"],
            gpu_count=count,
            image=image or _lab_image(shape, run_dir) or d["image"],
            region=region,
            ssh_public_keys=_ssh_keys(ssh_key),
            hostname=hostname,
        )
    except (ValidationError, ValueError, OSError) as exc:
        raise fail(f"[red]invalid request[/]: {_one_line(exc)}", EXIT_USAGE) from None
    url = resolve_nats_url(nats_url, run_dir)
    failure = {"rejected", A.UNSCHEDULABLE, A.FAILED, A.RELEASING, A.RELEASED}
    publish_and_follow(
        bus_identity(url, creds, run_dir, "portal"),
        "allocation.requested",
        request,
        follow_answer=wait,
        timeout=timeout,
        initial="requested",
        said="requested",
        decide=lambda kind, _p: "ok" if kind == "active" else "fail" if kind in failure else None,
        as_json=as_json,
        print_id=True,
    )


def release(
    allocation_id: Annotated[str, typer.Argument(help="The allocation to release (its UUID).")],
    reason: Annotated[Optional[str], typer.Option("--reason", help="Why, recorded on the timeline.")] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Follow until released (exit 0) or failed (exit 1), not just accepted.")
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for an answer.")] = 180.0,
    as_json: JsonOpt = False,
    nats_url: NatsUrlOpt = None,
    creds: CredsOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Publish allocation.release_requested and wait for the allocator's answer: releasing (exit 0) or
    release_rejected (exit 1: unknown, already released, ended); with --wait follow it to released.

    Example: gpuaas release "$ID" --reason done --wait"""
    from gpuaas_common.contract.messages import AllocationReleaseRequested

    try:
        alloc = uuid.UUID(allocation_id)
    except ValueError:
        raise bad_id("allocation", allocation_id) from None
    try:
        request = AllocationReleaseRequested(allocation_id=alloc, reason=reason)
    except ValueError as exc:
        raise fail(f"[red]invalid request[/]: {_one_line(exc)}", EXIT_USAGE) from None
    url = resolve_nats_url(nats_url, run_dir)

    def decide(kind: str, payload: dict) -> Optional[str]:
        if kind == "release_rejected":
            # A release already under way is no failure: wait for it, or take it as the answer.
            if payload.get("reason_code") == "already_releasing":
                return None if wait else "ok"
            return "fail"
        if kind == "released":
            return "ok"
        if kind == "failed":
            return "fail"
        if kind == "releasing" and not wait:
            return "ok"
        return None

    publish_and_follow(
        bus_identity(url, creds, run_dir, "portal"),
        "allocation.release_requested",
        request,
        follow_answer=True,
        timeout=timeout,
        initial="release_requested",
        said="release requested for",
        decide=decide,
        as_json=as_json,
    )
