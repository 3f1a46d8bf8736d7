"""SSH facts of a slice guest: the host key the seed plants, the agent's own login key, and the login that
proves the guest is ready.

A guest is ready when the agent has logged in with its key, the guest presented exactly the host key its
seed planted (OpenSSH refuses any other: StrictHostKeyChecking against a known_hosts of that one key),
cloud-init has finished, and the image's readiness unit has reported the GPUs the guest sees; the same login
reads that report. An SSH banner alone shows only that sshd started, possibly with a key of its own
making. OpenSSH's client does the protocol; we only read its exit status and words.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpuaas_common.logging import get_logger

from ..domain.guest_gpus import GUEST_GPU_FILE, REPORT_MAX_BYTES
from .disk import run_tool

log = get_logger(__name__)

# What cloud-init writes when its last stage is done: the tenant's users and keys are in place.
BOOT_FINISHED = "/var/lib/cloud/instance/boot-finished"
# Run by the guest user's shell. Exit codes of our own, above what `test` and `head` use: 10 cloud-init has not
# finished, 11 the readiness unit has not written the GPU report yet.
_NOT_FINISHED, _NO_REPORT = 10, 11
READINESS_COMMAND = (
    f"test -e {BOOT_FINISHED} || exit {_NOT_FINISHED}; test -s {GUEST_GPU_FILE} || exit {_NO_REPORT}; "
    f"head -c {REPORT_MAX_BYTES + 1} {GUEST_GPU_FILE}"
)
_MISMATCH_WORDS = ("Host key verification failed", "REMOTE HOST IDENTIFICATION HAS CHANGED")


class GuestSshError(RuntimeError):
    pass


@dataclass(frozen=True)
class HostKey:
    private_openssh: str  # goes into the seed only, never into a log or an event
    public_line: str  # "ssh-ed25519 AAAA…"

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_line)

    @classmethod
    def from_private(cls, private_openssh: str) -> HostKey:
        """The key pair from its private half alone (the public key is part of an OpenSSH private key)."""
        try:
            key = serialization.load_ssh_private_key(private_openssh.encode(), password=None)
        except (ValueError, TypeError) as exc:
            raise GuestSshError("not an unencrypted OpenSSH private key") from exc
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        return cls(private_openssh, public.decode())


def new_host_key() -> HostKey:
    """A fresh ed25519 key pair in OpenSSH's formats, made in memory."""
    private = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    return HostKey.from_private(private.decode())


def fingerprint(public_line: str) -> str:
    """OpenSSH's SHA256 fingerprint (`ssh-keygen -lf`): unpadded base64 of the sha256 of the key blob."""
    try:
        blob = base64.b64decode(public_line.split()[1], validate=True)
    except (IndexError, ValueError) as exc:
        raise GuestSshError(f"not an OpenSSH public key: {public_line[:40]!r}") from exc
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


async def agent_login_key(state_dir: Path) -> tuple[Path, str]:
    """The agent's own login key (made once, 0600 in its state dir) and its public line, which every seed
    authorises so that the readiness check can log in."""
    return await _node_local_key(state_dir / "readiness_ed25519")


# Where the runbook keeps it (slice-node-bootstrap, "Slice Terminal Follow-Up": terminal/id_ed25519 under the
# agent's state dir). Apart from the readiness key so that either can be rotated or revoked alone.
RELAY_KEY = Path("terminal") / "id_ed25519"


async def relay_key(state_dir: Path) -> tuple[Path, str]:
    """The node-local terminal relay key (made once, 0600) and its public line: every seed authorises it for the
    guest user, and the slice terminal logs in with it, from this host only."""
    return await _node_local_key(state_dir / RELAY_KEY)


async def _node_local_key(key: Path) -> tuple[Path, str]:
    def _load_or_make() -> str:
        if key.exists():
            return HostKey.from_private(key.read_text()).public_line
        made = new_host_key()
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = key.parent / f".{key.name}-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        # 0600 from the first byte: ssh refuses a private key others can read, and so should we.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(made.private_openssh)
        tmp.replace(key)
        return made.public_line

    return key, await asyncio.to_thread(_load_or_make)


@dataclass(frozen=True)
class LoginOutcome:
    ok: bool
    host_key_mismatch: bool = False
    detail: str = ""
    # With `ok`: the guest's GPU report as it wrote it (guest_gpus.parse_report reads it).
    gpu_report: str | None = None
    # Logged in and cloud-init done, but the guest has not reported its GPUs (yet).
    report_missing: bool = False


async def login(
    ip: str, port: int, user: str, key: Path, host_public_line: str, *, timeout_s: float = 15.0
) -> LoginOutcome:
    """Log in once, check that cloud-init finished and read the guest's GPU report. `ok` only when the guest
    showed the planted host key, accepted the agent's key, has BOOT_FINISHED and a report."""
    with tempfile.TemporaryDirectory(prefix="gpuaas-ssh-") as tmp:
        known_hosts = Path(tmp) / "known_hosts"
        host = ip if port == 22 else f"[{ip}]:{port}"
        kind, blob = host_public_line.split()[:2]
        known_hosts.write_text(f"{host} {kind} {blob}\n")
        argv = [
            "ssh",
            "-F", "/dev/null",
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"HostKeyAlgorithms={kind}",
            "-o", "IdentitiesOnly=yes",
            "-o", "ConnectTimeout=5",
            "-o", "LogLevel=ERROR",
            "-i", str(key),
            "-p", str(port),
            f"{user}@{ip}",
            READINESS_COMMAND,
        ]  # fmt: skip
        try:
            res = await run_tool(*argv, timeout_s=timeout_s)
        except TimeoutError:
            return LoginOutcome(False, detail="ssh timed out")
        rc, out, err = res.rc, res.stdout, res.stderr
    if rc == 0:
        return LoginOutcome(True, gpu_report=out)
    err = err.strip()
    if any(w in err for w in _MISMATCH_WORDS):
        return LoginOutcome(
            False, host_key_mismatch=True, detail="the guest's host key is not the one its seed planted"
        )
    if rc == _NOT_FINISHED:
        return LoginOutcome(False, detail="logged in; cloud-init has not finished")
    if rc == _NO_REPORT:
        return LoginOutcome(
            False, report_missing=True, detail=f"logged in, cloud-init done; the guest has not written {GUEST_GPU_FILE}"
        )
    return LoginOutcome(False, detail=err.splitlines()[-1][:300] if err else f"ssh exited {rc}")
