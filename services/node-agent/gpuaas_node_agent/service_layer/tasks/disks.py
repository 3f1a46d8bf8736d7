"""What every task that touches a slot disk shares: the identity check run before the disk is touched, and the
wipe's proof as the contract carries it."""

from __future__ import annotations

from pathlib import Path

from gpuaas_common.contract import messages as m

from ...adapters import disk
from ...adapters.discovery import block_use
from ...adapters.host import Host
from .context import Refused


def check_disk(host: Host, by_id: str) -> Path:
    """The disk behind a stable by-id link, refused unless it is a whole, unmounted, unheld NVMe disk that is
    not the OS disk (children checked one by one: a lab wipe once hit a disk whose partition was mounted)."""
    fs = host.fs
    if not by_id.startswith("/dev/disk/by-id/"):
        raise Refused("disk_identity_unstable", f"{by_id} is not a /dev/disk/by-id path")
    if not fs.exists(by_id):
        raise Refused("disk_missing", f"{by_id} does not resolve on this host")
    real = fs.realpath(by_id)
    if not real.startswith("/dev/") or real.count("/") != 2:
        raise Refused("disk_missing", f"{by_id} resolves to {real}, not a device node")
    use = block_use(fs, real.rsplit("/", 1)[-1])
    refusal = use.refusal()
    if refusal:
        raise Refused(refusal[0], f"{by_id}: {refusal[1]}")
    return fs.agent_path(by_id)


def wipe_proof(by_id: str, proof: disk.WipeProof) -> m.WipeProof:
    return m.WipeProof(
        device=by_id,
        method=proof.method,
        verified=proof.verified,
        signatures=[str(sig) for sig in proof.signatures],
        detail=proof.detail,
        verification=proof.verification,
    )
