"""cloud-init NoCloud seed ISO (volume `cidata`) written with pycdlib, no root and no external tools."""

from __future__ import annotations

import asyncio
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pycdlib
import yaml

from gpuaas_common.logging import get_logger

log = get_logger(__name__)

VOLUME_LABEL = "cidata"
# The guest user the slice terminal's relay key logs in as (the agent's GPUAAS_CONSOLE_USER).
CONSOLE_USER = "gpuaas-console"
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_USERNAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_KEY = re.compile(
    r"^(ssh-(ed25519|rsa|dss)|ecdsa-sha2-nistp(256|384|521)|sk-(ssh-ed25519|ecdsa-sha2-nistp256)@openssh\.com)"
    r" [A-Za-z0-9+/=]+( .*)?$"
)

# ISO 9660 names cannot hold '-'; cloud-init reads the Rock Ridge / Joliet names.
_FILES = {"user-data": "/USERDATA.;1", "meta-data": "/METADATA.;1", "network-config": "/NETCONF.;1"}


class SeedIsoError(ValueError):
    pass


def _check_key(key: str) -> str:
    key = key.strip()
    if "\n" in key or "\r" in key or not _KEY.match(key):
        raise SeedIsoError(f"not a single-line OpenSSH public key: {key[:40]!r}…")
    return key


def render_user_data(
    *,
    hostname: str,
    ssh_authorized_keys: list[str],
    username: str | None = None,
    relay_public_key: str | None = None,
    console_user: str = CONSOLE_USER,
    host_key: tuple[str, str] | None = None,
) -> str:
    """`#cloud-config` user-data. Without `username` the keys go to the image's default user; with it, a
    passwordless-sudo user of that name is created (the tenant's own login: its keys, and the agent's readiness
    key). The node-local terminal relay key, when given, is authorised for `console_user` only: a user of its
    own with no sudo rule, no group and no root, so whoever holds the relay key (the host, or the control plane
    that opens consoles) gets the tenant's console, never a root shell (review 3, N8)."""
    if not _HOSTNAME.match(hostname):
        raise SeedIsoError(f"invalid hostname {hostname!r}")
    keys = [_check_key(k) for k in ssh_authorized_keys]
    relay = _check_key(relay_public_key) if relay_public_key else None
    if relay is not None and relay in keys:
        raise SeedIsoError("the terminal relay key must not be one of the login keys: it is the console's alone")
    if not keys:
        raise SeedIsoError("at least one SSH public key is required: the VM has no password login")
    if relay is not None and (not _USERNAME.match(console_user) or console_user in ("root", username)):
        raise SeedIsoError(f"invalid console user {console_user!r}: a name of its own, not root or the login user")
    # disable_root: cloud-init answers any key it puts on root with a refusal; said here, not left to the image.
    doc: dict[str, Any] = {"hostname": hostname, "preserve_hostname": False, "ssh_pwauth": False, "disable_root": True}
    if host_key is not None:
        # (private, public) ed25519: the guest serves exactly this key, so the first login can be verified
        # against what the seed planted instead of trusting whatever key sshd made at first boot.
        private, public = host_key
        if not private.startswith("-----BEGIN OPENSSH PRIVATE KEY-----") or not public.startswith("ssh-ed25519 "):
            raise SeedIsoError("host key must be an ed25519 OpenSSH key pair")
        doc["ssh_deletekeys"] = True
        doc["ssh_genkeytypes"] = []
        doc["ssh_keys"] = {"ed25519_private": private, "ed25519_public": public}
    users: list[Any]
    if username is None:
        users = ["default"]
        doc["ssh_authorized_keys"] = keys
    else:
        if not _USERNAME.match(username):
            raise SeedIsoError(f"invalid username {username!r}")
        users = [
            {
                "name": username,
                "groups": ["sudo"],
                "shell": "/bin/bash",
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
                "lock_passwd": True,
                "ssh_authorized_keys": keys,
            }
        ]
    if relay is not None:
        # `sudo: false` writes no sudoers rule; no `groups`, so none of sudo, adm or wheel; the password locked.
        users.append(
            {
                "name": console_user,
                "gecos": "gpuaas slice console",
                "shell": "/bin/bash",
                "sudo": False,
                "lock_passwd": True,
                "ssh_authorized_keys": [relay],
            }
        )
    doc["users"] = users
    return "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def render_meta_data(*, instance_id: str, hostname: str) -> str:
    if not instance_id or any(c.isspace() for c in instance_id):
        raise SeedIsoError(f"invalid instance_id {instance_id!r}")
    if not _HOSTNAME.match(hostname):
        raise SeedIsoError(f"invalid hostname {hostname!r}")
    return yaml.safe_dump({"instance-id": instance_id, "local-hostname": hostname}, sort_keys=False)


def build_seed_iso_bytes(files: dict[str, str]) -> bytes:
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, joliet=3, rock_ridge="1.09", vol_ident=VOLUME_LABEL)
    try:
        for name, content in files.items():
            data = content.encode("utf-8")
            iso.add_fp(io.BytesIO(data), len(data), _FILES[name], rr_name=name, joliet_path=f"/{name}")
        out = io.BytesIO()
        iso.write_fp(out)
        return out.getvalue()
    finally:
        iso.close()


def _write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # QEMU runs as its own user on real hosts and must be able to read the seed; a seed holding the guest's
        # private host key stays 0600 (libvirt's dynamic ownership hands it to QEMU's user while the VM runs).
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def write_seed_iso(
    path: str | os.PathLike[str],
    *,
    instance_id: str,
    hostname: str,
    ssh_authorized_keys: list[str],
    username: str | None = None,
    relay_public_key: str | None = None,
    console_user: str = CONSOLE_USER,
    network_config: dict[str, Any] | str | None = None,
    host_key: tuple[str, str] | None = None,
) -> Path:
    """Render and write the seed ISO atomically (a reader never sees a half-written image); returns its path.
    `network_config` is a network-config v2 document (dict) or its YAML text."""
    files = {
        "user-data": render_user_data(
            hostname=hostname,
            ssh_authorized_keys=ssh_authorized_keys,
            username=username,
            relay_public_key=relay_public_key,
            console_user=console_user,
            host_key=host_key,
        ),
        "meta-data": render_meta_data(instance_id=instance_id, hostname=hostname),
    }
    if network_config is not None:
        files["network-config"] = (
            network_config if isinstance(network_config, str) else yaml.safe_dump(network_config, sort_keys=False)
        )
    target = Path(path)

    def _build_and_write() -> None:
        _write_atomically(target, build_seed_iso_bytes(files), 0o600 if host_key else 0o644)

    await asyncio.to_thread(_build_and_write)
    log.info(
        "seed_iso_written",
        path=str(target),
        instance_id=instance_id,
        hostname=hostname,
        keys=len(ssh_authorized_keys) + (1 if relay_public_key else 0),
        network_config=network_config is not None,
    )
    return target
