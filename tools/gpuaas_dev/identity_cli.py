"""Which identity a command line acts as on the bus."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from gpuaas_common.natsconn import NatsIdentity, split_servers


def cli_identity(url: str, creds: Optional[Path], run_dir: Path, role: str) -> NatsIdentity:
    """--creds, else $GPUAAS_NATS_CREDS, else the dev stack's creds for `role` (when `url` is its NATS);
    the CA likewise from $GPUAAS_NATS_CA_FILE or the stack. Raises FileNotFoundError for a missing file."""
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
    return NatsIdentity(split_servers(url), str(creds) if creds else None, ca)
