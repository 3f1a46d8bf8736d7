"""The credential authority as a process of its own (`gpuaas-credential-authority`), for tests that ask it across
the process boundary the way the gateway does: its keys in a 0700 directory, its own creds, an HTTPS certificate
from the test's CA, and its port named in its ready file."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuaas_common.identity import Authority
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import AUTHORITY, ROLE_PERMISSIONS
from gpuaas_common.identity.tls import TlsFiles, issue_server_cert
from gpuaas_dev.stack.processes import _Proc, bin_path, spawn, wait_until_ready


@contextmanager
def authority_process(
    authority: Authority,
    tls: TlsFiles,
    nats_url: str,
    work: Path,
    *,
    callers: str = "maas-gateway",
    deploy_command_max_age_s: float | None = None,
) -> Iterator[str]:
    """Runs the authority until the block ends; yields its https:// URL."""
    keys, creds = work / "keys", work / "creds"
    authority.save(keys)
    creds_files.write(creds / f"{AUTHORITY}.creds", authority.issue_user(AUTHORITY, ROLE_PERMISSIONS[AUTHORITY]))
    cert = issue_server_cert(tls.ca.parent, f"{AUTHORITY}-{os.getpid()}-{time.monotonic_ns()}")
    ready = work / "authority-ready.json"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "GPUAAS_NATS_URL": nats_url,
        "GPUAAS_NATS_CREDS": str(creds / f"{AUTHORITY}.creds"),
        "GPUAAS_NATS_CA_FILE": str(tls.ca),
        "GPUAAS_KEYS_DIR": str(keys),
        "GPUAAS_API_TLS_CERT_FILE": str(cert.cert),
        "GPUAAS_API_TLS_KEY_FILE": str(cert.key),
        "GPUAAS_CALLERS": callers,
        "GPUAAS_READY_FILE": str(ready),
        "GPUAAS_LOG_LEVEL": "INFO",
    }
    if deploy_command_max_age_s is not None:
        env["GPUAAS_DEPLOY_COMMAND_MAX_AGE_S"] = str(deploy_command_max_age_s)
    # Spawned and awaited as the dev stack does its processes: ready once its ready file names it and /readyz says so.
    proc = _Proc(AUTHORITY, [bin_path("gpuaas-credential-authority")], env, work / "authority.log", ready, "/readyz")
    spawn(proc, work)
    try:
        wait_until_ready({AUTHORITY: proc}, 60)
        yield f"https://127.0.0.1:{proc.info['api_port']}"
    finally:
        assert proc.proc is not None
        proc.proc.terminate()
        try:
            proc.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
            proc.proc.wait()


def log_of(work: Path) -> str:
    return (work / "authority.log").read_text()
