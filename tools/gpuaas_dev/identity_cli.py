"""Which identity a command line acts as on the bus."""

from __future__ import annotations

import json
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Optional

from gpuaas_common.natsconn import InsecureTransport, NatsIdentity, split_servers, transport_refusal

INSECURE_DEV_ENV = "GPUAAS_NATS_INSECURE_DEV"


# `gpuaas --insecure-dev`, set by the root command on every invocation (so one in-process run cannot leak into
# the next).
_flag = ContextVar("nats_insecure_dev", default=False)


def set_insecure_dev_flag(value: bool) -> None:
    _flag.set(value)


def insecure_dev() -> bool:
    """`gpuaas --insecure-dev …` or $GPUAAS_NATS_INSECURE_DEV: the one way to talk to a plaintext dev bus."""
    return _flag.get() or os.environ.get(INSECURE_DEV_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def checked_identity(identity: NatsIdentity) -> NatsIdentity:
    """Raises InsecureTransport (one line) for a nats:// URL or a missing CA without the insecure-dev flag."""
    refusal = transport_refusal(identity.servers, identity.ca_file, identity.insecure_dev)
    if refusal is not None:
        raise InsecureTransport(refusal)
    return identity


def cli_identity(url: str, creds: Optional[Path], run_dir: Path, role: str) -> NatsIdentity:
    """--creds, else $GPUAAS_NATS_CREDS, else the dev stack's creds for `role` (when `url` is its NATS);
    the CA likewise from $GPUAAS_NATS_CA_FILE or the stack. Raises FileNotFoundError for a missing file and
    InsecureTransport for plaintext or an unpinned CA without --insecure-dev."""
    try:
        info = json.loads((run_dir / "stack.json").read_text())
    except (OSError, ValueError):
        info = {}
    ours = url == info.get("nats_url")
    if creds is None and os.environ.get("GPUAAS_NATS_CREDS"):
        creds = Path(os.environ["GPUAAS_NATS_CREDS"])
    if creds is None and ours and info.get("creds_dir"):
        creds = Path(info["creds_dir"]) / f"{role}.creds"
    ca = os.environ.get("GPUAAS_NATS_CA_FILE") or (info.get("nats_ca_file") if ours else None)
    if creds is not None and not creds.is_file():
        raise FileNotFoundError(f"no such creds file: {creds}")
    return checked_identity(
        NatsIdentity(split_servers(url), str(creds) if creds else None, ca, insecure_dev=insecure_dev())
    )
