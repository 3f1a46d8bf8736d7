"""The MAAS simulator's HTTPS in the dev stack: its certificate comes from the stack's CA (the one NATS's comes
from, `<run-dir>/tls/ca.pem`), and every client of the simulator trusts that CA only, never the system store.

Plain HTTP is only for a stack started with `maas_insecure_http=True`, which a test names on purpose; the gateway
is then told so by GPUAAS_MAAS_INSECURE_HTTP and warns about it at start.
"""

from __future__ import annotations

import contextlib
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from gpuaas_common.identity.tls import TlsFiles, client_context, issue_server_cert, make_ca_and_server_cert

from .processes import MAAS_SIM


def issue_sim_cert(tls_dir: Path, *, ca_exists: bool) -> TlsFiles:
    """`<tls_dir>/maas-sim.pem` for 127.0.0.1 and localhost, from the CA in `tls_dir`; a stack without bus
    identities (`auth=False`) has no CA yet, and gets one there for the simulator alone."""
    if not ca_exists:
        make_ca_and_server_cert(tls_dir)
    return issue_server_cert(tls_dir, MAAS_SIM, hostnames=("localhost",), ips=("127.0.0.1",))


def client_ssl(ca_file: Path | None) -> ssl.SSLContext | None:
    """What a client of the simulator verifies it with: the stack's CA only; None for a plain-HTTP simulator."""
    return client_context(ca_file) if ca_file is not None else None


@contextlib.contextmanager
def urllib_trusts(ca_file: Path | None) -> Iterator[None]:
    """Within the block, `urllib.request.urlopen` without a `context` (code that only knows the simulator's URL:
    the lab machine's `_sim/` power call) verifies HTTPS against `ca_file` only; the opener in place before comes
    back after. None: nothing changes (a plain-HTTP simulator)."""
    if ca_file is None:
        yield
        return
    before = getattr(urllib.request, "_opener", None)
    urllib.request.install_opener(
        urllib.request.build_opener(urllib.request.HTTPSHandler(context=client_context(ca_file)))
    )
    try:
        yield
    finally:
        urllib.request.install_opener(before)  # type: ignore[arg-type]  # None: urlopen builds the default again
