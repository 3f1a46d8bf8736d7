"""TLS first, always (issue 24, point 3): a client of ours never says a word in plaintext to a NATS server.

nats-py upgrades to TLS only when the server's first line asks for it, unless it speaks TLS first. A relay that
forwards the real server's INFO without `tls_required` would otherwise get our CONNECT (JWT and signed nonce)
in clear. The fake server here is that relay: a loopback listener that sends such an INFO and records every
byte it gets back.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuaas_common.identity import Authority
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS
from gpuaas_common.identity.tls import TlsFiles
from gpuaas_common.natsconn import InsecureTransport, NatsIdentity
from gpuaas_common.settings import ServiceSettings
from gpuaas_common.startup import classify

# What nats-server 2.15 says first, less `tls_required`: a downgrading relay's forgery.
PLAIN_INFO = {
    "server_id": "NFAKE",
    "server_name": "relay",
    "version": "2.15.1",
    "proto": 1,
    "host": "127.0.0.1",
    "port": 4222,
    "headers": True,
    "auth_required": True,
    "max_payload": 1048576,
    "nonce": "abcdefghijklmnop",
}


@dataclass
class PlainRelay:
    """`answers`: like a plaintext nats-server, -ERR and close on bytes that are no protocol line; otherwise it
    keeps listening, as a relay waiting for a CONNECT would."""

    answers: bool
    port: int = 0
    received: bytearray = field(default_factory=bytearray)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"INFO " + json.dumps(PLAIN_INFO).encode() + b"\r\n")
        await writer.drain()
        try:
            while chunk := await reader.read(65536):
                self.received += chunk
                if self.answers and not self.received.startswith((b"CONNECT", b"PING")):
                    writer.write(b"-ERR 'Unknown Protocol Operation'\r\n")
                    await writer.drain()
                    break
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.closed.set()


@pytest.fixture(params=["answers", "waits"])
async def relay(request: pytest.FixtureRequest) -> AsyncIterator[PlainRelay]:
    relay = PlainRelay(answers=request.param == "answers")
    server = await asyncio.start_server(relay.handle, "127.0.0.1", 0)
    relay.port = server.sockets[0].getsockname()[1]
    try:
        yield relay
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def creds_file(tmp_path: Path, authority: Authority) -> Path:
    path = tmp_path / "allocator.creds"
    creds_files.write(path, authority.issue_user("allocator", ROLE_PERMISSIONS["allocator"]))
    return path


async def test_the_client_never_sends_connect_to_a_server_that_does_not_demand_tls(
    relay: PlainRelay, creds_file: Path, tls_files: TlsFiles
) -> None:
    identity = NatsIdentity([f"tls://127.0.0.1:{relay.port}"], str(creds_file), str(tls_files.ca))
    with pytest.raises((ssl.SSLError, TimeoutError)):
        await identity.connect(name="tls-first-test", retry_forever=False, allow_reconnect=False, connect_timeout=2)
    await asyncio.wait_for(relay.closed.wait(), 10)
    sent = bytes(relay.received)
    # All the relay got is the start of a TLS handshake: a ClientHello record, nothing of the protocol.
    assert sent[:1] == b"\x16", sent[:64]
    assert b"CONNECT" not in sent and b"nkey" not in sent and b"jwt" not in sent
    jwt = creds_files.read(str(creds_file)).jwt
    assert jwt.encode() not in sent
    expected = "TLS handshake failed" if relay.answers else "no TLS handshake"
    assert identity.last_error is not None and identity.last_error.startswith(expected), identity.last_error


def test_production_options_speak_tls_first(creds_file: Path, tls_files: TlsFiles) -> None:
    kwargs = NatsIdentity(["tls://127.0.0.1:4222"], str(creds_file), str(tls_files.ca)).connect_kwargs()
    assert kwargs["tls_handshake_first"] is True and isinstance(kwargs["tls"], ssl.SSLContext)


@pytest.mark.parametrize(
    ("servers", "pinned", "why"),
    [
        (["nats://127.0.0.1:4222"], True, "nats:// URL is plaintext"),
        (["tls://127.0.0.1:4222", "nats://127.0.0.1:4223"], True, "nats:// URL is plaintext"),
        (["tls://127.0.0.1:4222"], False, "needs GPUAAS_NATS_CA_FILE"),
    ],
)
def test_a_client_refuses_plaintext_or_an_unpinned_ca(
    servers: list[str], pinned: bool, why: str, creds_file: Path, tls_files: TlsFiles
) -> None:
    ca = str(tls_files.ca) if pinned else None
    identity = NatsIdentity(servers, str(creds_file), ca)
    with pytest.raises(InsecureTransport, match=why):
        identity.connect_kwargs()
    # The one exception, by name: an open dev bus.
    assert NatsIdentity(servers, str(creds_file), ca, insecure_dev=True).connect_kwargs()["servers"] == servers


@pytest.mark.parametrize(
    ("env", "setting", "why"),
    [
        ({"GPUAAS_NATS_URL": "nats://u:secret-pw@127.0.0.1:4222"}, "GPUAAS_NATS_URL", "nats:// URL is plaintext"),
        (
            {"GPUAAS_NATS_URL": "tls://127.0.0.1:4222", "GPUAAS_NATS_CREDS": "/x/allocator.creds"},
            "GPUAAS_NATS_CA_FILE",
            "needs GPUAAS_NATS_CA_FILE",
        ),
    ],
)
def test_settings_refuse_plaintext_without_the_insecure_dev_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], setting: str, why: str
) -> None:
    monkeypatch.delenv("GPUAAS_NATS_INSECURE_DEV")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(Exception) as caught:
        ServiceSettings()
    failure = classify(caught.value)
    assert failure.reason == "invalid_settings" and failure.exit_code == 78
    assert [e["setting"] for e in failure.fields["errors"]] == [setting]
    assert why in failure.detail and "secret-pw" not in failure.detail and "\n" not in failure.detail
    monkeypatch.setenv("GPUAAS_NATS_INSECURE_DEV", "true")
    assert ServiceSettings().nats_insecure_dev is True


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["events", "tail", "--nats-url", "nats://127.0.0.1:{port}"], True),
        (["events", "tail", "--nats-url", "tls://127.0.0.1:{port}"], True),
        (["--insecure-dev", "events", "tail", "--nats-url", "nats://127.0.0.1:{port}"], False),
    ],
)
def test_the_cli_refuses_plaintext_unless_told_insecure_dev(argv: list[str], refused: bool, tmp_path: Path) -> None:
    """A real process with an empty environment: no stack, no CA, no GPUAAS_NATS_INSECURE_DEV."""
    import subprocess
    import sys

    from gpuaas_dev.testing.servers import free_port

    gpuaas = str(Path(sys.executable).parent / "gpuaas")
    args = [a.format(port=free_port()) for a in argv]
    done = subprocess.run(
        [gpuaas, *args, "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    if refused:
        # 2: refused before anything was dialled.
        assert done.returncode == 2 and "refused to connect" in done.stderr and "--insecure-dev" in done.stderr
    else:
        assert done.returncode == 3 and "cannot connect to NATS" in done.stderr, done.stderr
