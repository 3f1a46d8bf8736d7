"""Portal commands: `gpuaas allocate` and `gpuaas release`, acting as the portal identity."""

import uuid
from pathlib import Path
from typing import Annotated, Optional

import typer

from .bus import bus_identity, resolve_nats_url
from .common import DEFAULT_RUN_DIR, CredsOpt, JsonOpt, NatsUrlOpt, RunDirOpt, err
from .follow import publish_and_follow

DEFAULTS = {
    "gpu_slice": {"sku": "h200-sxm-slice", "image": "ubuntu-24.04-h200-slice", "gpus": 1},
    "baremetal": {"sku": "h200-sxm", "image": "ubuntu-24.04-h200-host", "gpus": 8},
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
    url = resolve_nats_url(nats_url, run_dir)
    publish_and_follow(
        bus_identity(url, creds, run_dir, "portal"),
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
    url = resolve_nats_url(nats_url, run_dir)
    publish_and_follow(
        bus_identity(url, creds, run_dir, "portal"),
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
