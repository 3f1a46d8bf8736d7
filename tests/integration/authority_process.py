"""The credential authority as a process of its own (`gpuaas-credential-authority`), for tests that ask it across
the process boundary the way the gateway does: its keys in a 0700 directory, its own creds, an HTTPS certificate
from the test's CA, and its port named in its ready file."""

from __future__ import annotations

import json
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
from gpuaas_dev.stack.processes import bin_path


@contextmanager
def authority_process(
    authority: Authority, tls: TlsFiles, nats_url: str, work: Path, *, callers: str = "maas-gateway"
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
    log = (work / "authority.log").open("ab")
    proc = subprocess.Popen([bin_path("gpuaas-credential-authority")], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the authority did not start:\n{(work / 'authority.log').read_text()[-3000:]}")
            time.sleep(0.05)  # polling the ready file the process writes once it listens
        yield f"https://127.0.0.1:{json.loads(ready.read_text())['api_port']}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def log_of(work: Path) -> str:
    return (work / "authority.log").read_text()
