"""The dev stack's helpers for its HTTPS MAAS simulator, against a simulator serving the certificate the stack
issues: code that only knows the simulator's URL and calls `urllib.request.urlopen` without a context (the lab
machine's `_sim/` power call) trusts the stack's CA inside `urllib_trusts`, and nothing of it outlives the block."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpuaas_dev.maas_sim import SimConfig
from gpuaas_dev.maas_sim.server import start, tls_context
from gpuaas_dev.stack.maas_tls import client_ssl, issue_sim_cert, urllib_trusts

KEY = "consumerkey0000000:tokenkey0000000000:tokensecret00000000000000000000"


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """(base URL, CA file): the simulator over HTTPS with a certificate from a CA made as a stack without bus
    identities makes it."""
    files = issue_sim_cert(tmp_path / "tls", ca_exists=False)
    runner, port = await start(SimConfig(machines=2, api_key=KEY), ssl_context=tls_context(files.cert, files.key))
    try:
        yield f"https://127.0.0.1:{port}", files.ca
    finally:
        await runner.cleanup()


def _machines(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/_sim/machines", timeout=5) as resp:
        return list(json.loads(resp.read())["machines"])


async def test_urlopen_without_a_context_trusts_the_stacks_ca_only_inside_the_block(sim: tuple[str, Path]) -> None:
    url, ca = sim
    sentinel = urllib.request.build_opener()
    urllib.request.install_opener(sentinel)
    try:
        with urllib_trusts(ca):
            machines = await asyncio.to_thread(_machines, url)
        assert len(machines) == 2
        assert urllib.request._opener is sentinel, "the opener in place before is back"  # type: ignore[attr-defined]
    finally:
        urllib.request.install_opener(None)  # type: ignore[arg-type]
    # Outside the block the system store is all urllib has: the simulator's certificate is refused.
    with pytest.raises(urllib.error.URLError) as caught:
        await asyncio.to_thread(_machines, url)
    assert isinstance(caught.value.reason, ssl.SSLCertVerificationError), caught.value
    assert "certificate verify failed" in str(caught.value.reason)


async def test_a_plain_http_simulator_leaves_urllib_as_it_is() -> None:
    before = getattr(urllib.request, "_opener", None)
    with urllib_trusts(None):
        assert getattr(urllib.request, "_opener", None) is before
    assert client_ssl(None) is None


async def test_the_stacks_client_context_verifies_the_simulator(sim: tuple[str, Path]) -> None:
    url, ca = sim
    context = client_ssl(ca)
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname

    def fetch() -> int:
        with urllib.request.urlopen(f"{url}/_sim/healthz", timeout=5, context=context) as resp:
            return int(resp.status)

    assert await asyncio.to_thread(fetch) == 200
