"""MAAS over HTTPS with a pinned CA (issue 24, point 6).

The gateway's client trusts only GPUAAS_MAAS_CA_FILE: the simulator, serving a certificate from the dev CA, is
spoken to; a server whose certificate another CA signed is refused during the handshake, so neither the OAuth
key nor a request body reaches it. Plain http:// is refused at start unless GPUAAS_MAAS_INSECURE_HTTP says so,
and then a warning names the sites.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
from pydantic import SecretStr

from gpuaas_common.identity.tls import TlsFiles, issue_server_cert, make_ca_and_server_cert, server_context
from gpuaas_common.startup import classify
from gpuaas_dev.maas_sim import SimConfig
from gpuaas_dev.maas_sim.server import start
from gpuaas_maas_gateway.adapters.maas_client import MaasClient
from gpuaas_maas_gateway.adapters.maas_errors import MaasUnreachable
from gpuaas_maas_gateway.entrypoints.main import warn_plain_http
from gpuaas_maas_gateway.settings import GatewaySettings

KEY = "consumerkey0000000:tokenkey0000000000:tokensecret00000000000000000000"


@pytest.fixture
def dev_ca(tmp_path: Path) -> TlsFiles:
    """The dev stack's CA (the one NATS's certificate comes from) and the simulator's certificate from it."""
    make_ca_and_server_cert(tmp_path / "tls")
    return issue_server_cert(tmp_path / "tls", "maas-sim")


@pytest.fixture
async def https_sim(dev_ca: TlsFiles) -> AsyncIterator[str]:
    runner, port = await start(SimConfig(machines=2, api_key=KEY), ssl_context=server_context(dev_ca))
    try:
        yield f"https://127.0.0.1:{port}/MAAS/"
    finally:
        await runner.cleanup()


async def test_the_gateway_speaks_to_the_tls_simulator_through_its_pinned_ca(https_sim: str, dev_ca: TlsFiles) -> None:
    async with MaasClient(https_sim, KEY, timeout=5.0, ca_file=str(dev_ca.ca)) as client:
        machines = await client.list_machines()
    assert len(machines) == 2


async def test_a_certificate_from_another_ca_is_refused_before_anything_is_sent(
    tmp_path: Path, dev_ca: TlsFiles
) -> None:
    """An impostor with a certificate valid for 127.0.0.1 but signed by another CA: the handshake fails on our
    side, and the impostor never reads a byte of the request (the Authorization header, the form)."""
    impostor = make_ca_and_server_cert(tmp_path / "other")
    received: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            received.append(await reader.read(65536))
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context(impostor))
    port = server.sockets[0].getsockname()[1]
    try:
        async with MaasClient(f"https://127.0.0.1:{port}/MAAS/", KEY, timeout=5.0, ca_file=str(dev_ca.ca)) as client:
            with pytest.raises(MaasUnreachable) as caught:
                await client.deploy("abc123", distro_series="noble", user_data="#cloud-config\n")
    finally:
        server.close()
        await server.wait_closed()
    assert "TLS refused" in str(caught.value) and "GPUAAS_MAAS_CA_FILE" in str(caught.value)
    assert caught.value.outcome_unknown is False
    assert b"".join(received) == b"", "the impostor read part of the request"
    assert KEY.split(":")[2] not in str(caught.value)


@pytest.mark.parametrize(
    ("url", "extra", "setting", "why"),
    [
        ("http://maas.example:5240/MAAS/", {}, "GPUAAS_MAAS_INSECURE_HTTP", "is plain http://"),
        ("https://maas.example:5240/MAAS/", {}, "GPUAAS_MAAS_CA_FILE", "needs the CA"),
        ("ftp://maas.example/MAAS/", {}, "GPUAAS_MAAS_INSECURE_HTTP", "must be https://"),
    ],
)
def test_an_unpinned_or_plain_http_site_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, url: str, extra: dict, setting: str, why: str
) -> None:
    monkeypatch.delenv("GPUAAS_MAAS_INSECURE_HTTP")
    with pytest.raises(Exception) as caught:
        GatewaySettings(maas_url=url, maas_api_key=SecretStr(KEY), **extra)
    failure = classify(caught.value)
    assert failure.reason == "invalid_settings" and failure.exit_code == 78
    assert [e["setting"] for e in failure.fields["errors"]] == [setting]
    assert why in failure.detail and KEY not in failure.detail


def test_plain_http_only_when_named_and_then_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUAAS_MAAS_INSECURE_HTTP")
    settings = GatewaySettings(
        maas_url="http://127.0.0.1:5240/MAAS/", maas_api_key=SecretStr(KEY), maas_insecure_http=True
    )
    with structlog.testing.capture_logs() as logs:
        assert warn_plain_http(settings) == ["default"]
    (line,) = [entry for entry in logs if entry["event"] == "maas_plain_http"]
    assert line["log_level"] == "warning" and line["sites"] == ["default"] and KEY not in str(line)
    pinned = GatewaySettings(maas_url="https://maas:5443/MAAS/", maas_api_key=SecretStr(KEY), maas_ca_file="ca.pem")
    with structlog.testing.capture_logs() as logs:
        assert warn_plain_http(pinned) == []
    assert logs == []
