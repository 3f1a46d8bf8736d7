"""Session-wide real servers (one nats-server, one Postgres on free loopback ports) and per-test clients of them."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import nats
import pytest
from nats.js import JetStreamContext

from gpuaas_common.identity import Authority
from gpuaas_common.identity.tls import TlsFiles, make_ca_and_server_cert
from gpuaas_common.jetstream import provision
from gpuaas_dev.testing.servers import NatsServer, PostgresServer

# The allocator and the MAAS gateway have no default enrolment secret (their settings refuse to start without
# one): every test process gets one, as `gpuaas dev up` and compose give one to every service.
TEST_ENROLMENT_SECRET = "test-enrolment-secret-of-the-suite"


@pytest.fixture(scope="session", autouse=True)
def enrolment_secret() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUAAS_ENROLMENT_SECRET", TEST_ENROLMENT_SECRET)
        yield TEST_ENROLMENT_SECRET


@pytest.fixture(scope="session", autouse=True)
def nats_insecure_dev() -> Iterator[None]:
    """The session's nats-server is an open plaintext dev bus, so every test process (and a service it starts)
    says so by name; a test of the TLS-only refusal takes the variable away."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUAAS_NATS_INSECURE_DEV", "true")
        # Likewise the MAAS simulators the tests start serve plain HTTP; test_maas_tls.py serves HTTPS.
        mp.setenv("GPUAAS_MAAS_INSECURE_HTTP", "true")
        yield


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    # Non-durable on purpose: a throwaway database where a commit without fsync costs several times less; the
    # tests of crash safety start durable servers of their own (test_postgres_recovery.py).
    server = PostgresServer(tmp_path_factory.mktemp("pg"), unsafe_no_fsync=True).start()
    yield server
    server.stop()


@pytest.fixture
async def fresh_db(postgres_server: PostgresServer) -> AsyncIterator[str]:
    """A database of its own for one test, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_server.dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    dsn = postgres_server.dsn.rsplit("/", 1)[0] + f"/{name}"
    yield dsn
    admin = await asyncpg.connect(postgres_server.dsn)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[JetStreamContext]:
    """JetStream on the session's server, every stream provisioned, on a connection of the test's own."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await provision(js)
    yield js
    await nc.drain()


# A trust chain and a TLS CA of their own for each module that runs an operator-mode nats-server.
@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority.create()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_ca_and_server_cert(tmp_path_factory.mktemp("tls"))
