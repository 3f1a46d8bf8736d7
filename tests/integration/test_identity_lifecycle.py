"""Credentials follow the host's life (issue 24, point 5), against a real nats-server in operator mode with TLS.

- A revocation survives a server restart with its config rendered again, as the dev stack and chaos runs do:
  the preloaded account JWT must never replace the one that carries the ledger.
- A slice host's users end before the gateway deploys the host for a baremetal tenant (who gets root on the disk
  that holds their creds file), asked of the credential authority, and the deploy waits while they cannot be ended.
- The deploy's host user is minted for the allocator's command as the MAAS stream holds it (issue 38): a command
  that asks for another node, or one of an allocation already ended, fails the deploy with the authority's reason,
  and MAAS is never called.
- Admin lives hours; the other roles and hosts no longer than the ledger remembers a revocation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import nats
import pytest
import pytest_asyncio
from pydantic import SecretStr

from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.db import create_pool
from gpuaas_common.identity import Authority, Creds
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.authority import (
    ADMIN_USER_TTL_S,
    MAX_USER_TTL_S,
    host_users,
    node_users,
    record_host_users,
    revoked_users,
)
from gpuaas_common.identity.permissions import ADMIN, ROLE_PERMISSIONS
from gpuaas_common.identity.tls import TlsFiles, client_context
from gpuaas_common.jetstream import provision
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_dev.maas_sim import SimConfig, start, state_of, system_id_for
from gpuaas_dev.testing.nats_clients import connect_as
from gpuaas_dev.testing.servers import NatsServer, free_port
from gpuaas_maas_gateway.adapters.credential_authority import AuthorityClient
from gpuaas_maas_gateway.adapters.host_credentials import HostCredentials
from gpuaas_maas_gateway.adapters.repository import PostgresGateway, gateway_repositories, unit_of_work_factory
from gpuaas_maas_gateway.entrypoints.main import build_clients
from gpuaas_maas_gateway.service_layer.commands import OperationHandlers
from gpuaas_maas_gateway.service_layer.worker import OperationWorker
from gpuaas_maas_gateway.settings import GatewaySettings, SiteProfile

from .authority_process import authority_process
from .deploy_commands import publish_command

KEY = "Gw7sQ2mZp9LxVb3Nq4:Gt8wR1nYc6HjDf2Gs5:Gs3vB9mQ7pL2kJ8hG4fD1sA6zX0cV5bN"
NODE = "bm:01"  # a ':' as node ids may have and KV keys may not
MACHINE = "bm-01"  # the simulator's one machine
ALLOCATION = str(uuid.uuid4())


@pytest.fixture
def server(tmp_path: Path, authority: Authority, tls_files: TlsFiles) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path / "nats", auth=authority, tls=tls_files).start()
    yield srv
    srv.stop()


@pytest.fixture
def authority() -> Authority:  # one per test: revocations of one test must not meet another's
    return Authority.create()


def _wait_for_the_clock(second: int) -> None:
    """What these tests wait for is the wall clock itself (JWT iat has one-second resolution)."""
    while time.time() < second:
        time.sleep(0.05)


async def connect(server: NatsServer, tls_files: TlsFiles, creds: Creds, **kw: object) -> nats.NATS:
    return await connect_as(server.url, tls_files.ca, creds, **kw)


@pytest_asyncio.fixture
async def admin(server: NatsServer, tls_files: TlsFiles, authority: Authority) -> AsyncIterator[nats.NATS]:
    nc = await connect(server, tls_files, authority.issue_user(ADMIN, ROLE_PERMISSIONS[ADMIN]))
    await provision(nc.jetstream())
    yield nc
    await nc.close()


async def test_a_revocation_survives_a_server_restart(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS
) -> None:
    revoked, kept = authority.issue_host("r1"), authority.issue_host("r2")
    await authority.issuer().revoke(
        [server.url], [str(revoked.claims["sub"])], js=admin.jetstream(), tls=client_context(tls_files.ca)
    )
    await admin.close()
    server.stop()
    # The pushed JWT's iat is at most a second past the revocation: from two seconds on, a preload rendered
    # with the time of the render would be the newer one and replace it.
    _wait_for_the_clock(int(time.time()) + 2)
    server.start()  # the config, preload included, is rendered again

    with pytest.raises(Exception, match="(?i)authorization violation"):
        await connect(server, tls_files, revoked)
    other = await connect(server, tls_files, kept)
    await other.close()


def test_the_preloaded_account_jwt_is_the_same_at_every_render(authority: Authority, tmp_path: Path) -> None:
    first = authority.server_config(tmp_path)
    _wait_for_the_clock(int(time.time()) + 1)
    assert authority.server_config(tmp_path) == first
    authority.save(tmp_path / "keys")
    assert Authority.load(tmp_path / "keys").server_config(tmp_path) == first


# --- a slice host deployed for a tenant ------------------------------------------------------------------------


@pytest_asyncio.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "maas_gateway", "gpuaas_maas_gateway.migrations")
    await conn.close()
    p = await create_pool(fresh_db, "maas_gateway", min_size=2, max_size=10)
    yield p
    await p.close()


@pytest_asyncio.fixture
async def sim() -> AsyncIterator[tuple[object, int]]:
    runner, port = await start(SimConfig(machines=1, api_key=KEY, seed=7), "127.0.0.1", 0)
    yield state_of(runner), port
    await runner.cleanup()


def gateway_settings(port: int) -> GatewaySettings:
    return GatewaySettings(
        maas_url=f"http://127.0.0.1:{port}/MAAS/",
        maas_insecure_http=True,
        maas_api_key=SecretStr(KEY),
        maas_timeout_s=2.0,
        maas_poll_interval_s=0.05,
        maas_grace_s=5.0,
        maas_deadline_s=60.0,
        enrolment_secret=SecretStr("a-test-enrolment-secret-of-32-chars"),
        site_profiles={"h200-baremetal": SiteProfile(distro_series="noble")},
    )


async def record_deploy(pool: asyncpg.Pool, settings: GatewaySettings, op_id: str, command_seq: int | None) -> None:
    """The gateway's command handler takes the deploy (`command_seq`: where the bus holds its command)."""
    type_ = "maas.deploy_requested"
    model = spec_for(type_).model(
        operation_id=op_id,
        allocation_id=ALLOCATION,
        site="default",
        system_id=system_id_for(MACHINE),
        node_id=NODE,
        profile="h200-baremetal",
    )
    env = Envelope.wrap(type_, model.model_dump(mode="json"), producer="allocator", correlation_id=op_id)
    ctx = HandlerContext(env, model, spec_for(type_).address, "maas-gateway-commands", 1, stream_seq=command_seq)
    assert await deliver(
        OperationHandlers(settings).on_command,
        ctx,
        UnitOfWork(pool, "maas_gateway", "maas-gateway", gateway_repositories),
    )


def gateway_client(authority: Authority, tls_files: TlsFiles, url: str, tmp_path: Path) -> AuthorityClient:
    """The gateway as it asks the credential authority: its own creds sign each request."""
    creds = creds_files.write(
        tmp_path / "maas-gateway.creds", authority.issue_user("maas-gateway", ROLE_PERMISSIONS["maas-gateway"])
    )
    return AuthorityClient(url, str(tls_files.ca), str(creds))


async def allocators_deploy(server: NatsServer, tls_files: TlsFiles, authority: Authority, node_id: str = NODE) -> int:
    """The allocator's deploy command on the bus (its own identity); its MAAS stream sequence."""
    nc = await connect(server, tls_files, authority.issue_user("allocator", ROLE_PERMISSIONS["allocator"]))
    try:
        return await publish_command(
            nc, "maas.deploy_requested", producer="allocator", node_id=node_id, allocation_id=ALLOCATION
        )
    finally:
        await nc.close()


async def run_deploy(pool: asyncpg.Pool, port: int, client: AuthorityClient, command_seq: int) -> asyncpg.Record:
    await record_deploy(pool, gateway_settings(port), "deploy-1", command_seq)
    return await step_deploy(pool, port, client)


async def step_deploy(pool: asyncpg.Pool, port: int, client: AuthorityClient) -> asyncpg.Record:
    """One step of the gateway's worker on the recorded deploy; the operation's row after it."""
    settings = gateway_settings(port)
    creds = HostCredentials(client, unit_of_work_factory(pool), ttl_s=3600)
    worker = OperationWorker(settings, PostgresGateway(pool), build_clients(settings), host_credentials=creds)
    try:
        await worker.step("deploy-1")
    finally:
        for site in worker.sites.values():
            await site.client.close()
    return await pool.fetchrow(
        "SELECT state, maas_calls, reason_code, status_message FROM maas_operations WHERE operation_id = 'deploy-1'"
    )


async def test_a_slice_host_is_revoked_before_it_is_deployed_for_a_tenant(
    pool: asyncpg.Pool,
    sim: tuple[object, int],
    server: NatsServer,
    tls_files: TlsFiles,
    authority: Authority,
    admin: nats.NATS,
    tmp_path: Path,
) -> None:
    state, port = sim
    slice_creds = authority.issue_host(NODE)
    await record_host_users(admin.jetstream(), NODE, authority.issued_hosts[NODE])  # as onboarding does
    neighbour = authority.issue_host("slice-02")
    await record_host_users(admin.jetstream(), "slice-02", authority.issued_hosts["slice-02"])
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    host = await connect(server, tls_files, slice_creds, closed_cb=on_closed)

    seq = await allocators_deploy(server, tls_files, authority)
    with authority_process(authority, tls_files, server.url, tmp_path / "authority") as url:
        client = gateway_client(authority, tls_files, url, tmp_path)
        row = await run_deploy(pool, port, client, seq)
        # A second deploy of the host ends the tenant's user the first one minted (issue 38: a node has one live
        # host user, so the next deploy's mint follows), and then nothing more is pushed.
        assert await client.end_slice_identity(NODE) == 1
        assert await client.end_slice_identity(NODE) == 0

    assert (row["state"], row["maas_calls"]) == ("accepted", 1)
    assert state.call_count("deploy", system_id_for(MACHINE)) == 1  # type: ignore[attr-defined]
    await asyncio.wait_for(closed.wait(), timeout=5)  # its live connection ended with the revocation
    assert host.is_closed
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await connect(server, tls_files, slice_creds)
    other = await connect(server, tls_files, neighbour)  # no other host's identity ended
    await other.close()
    assert str(slice_creds.claims["sub"]) in await revoked_users(admin.jetstream())


async def test_the_deploy_waits_while_the_slice_identity_cannot_be_ended(
    pool: asyncpg.Pool,
    sim: tuple[object, int],
    server: NatsServer,
    tls_files: TlsFiles,
    authority: Authority,
    admin: nats.NATS,
    tmp_path: Path,
) -> None:
    state, port = sim
    slice_creds = authority.issue_host(NODE)
    await record_host_users(admin.jetstream(), NODE, authority.issued_hosts[NODE])
    # The credential authority is down (nothing listens at its address): no revocation can be pushed.
    row = await run_deploy(
        pool,
        port,
        gateway_client(authority, tls_files, f"https://127.0.0.1:{free_port()}", tmp_path),
        await allocators_deploy(server, tls_files, authority),
    )

    assert (row["state"], row["maas_calls"]) == ("pending", 0)
    assert state.call_count("deploy", system_id_for(MACHINE)) == 0  # type: ignore[attr-defined]
    host = await connect(server, tls_files, slice_creds)  # still the slice host's, and nothing was deployed
    await host.close()


async def test_a_deploy_whose_command_asks_for_another_host_fails_with_the_authoritys_reason(
    pool: asyncpg.Pool,
    sim: tuple[object, int],
    server: NatsServer,
    tls_files: TlsFiles,
    authority: Authority,
    admin: nats.NATS,
    tmp_path: Path,
) -> None:
    """The operation names a command the bus holds for another node: a gateway (or its database) that says
    otherwise gets no host user. The deploy fails at once with the reason, not retried, and MAAS is never called."""
    state, port = sim
    seq = await allocators_deploy(server, tls_files, authority, node_id="bm-99")
    with authority_process(authority, tls_files, server.url, tmp_path / "authority") as url:
        row = await run_deploy(pool, port, gateway_client(authority, tls_files, url, tmp_path), seq)

    assert (row["state"], row["maas_calls"], row["reason_code"]) == ("failed", 0, "deploy_command_mismatch")
    assert "bm-99" in row["status_message"]
    assert state.call_count("deploy", system_id_for(MACHINE)) == 0  # type: ignore[attr-defined]
    assert await node_users(admin.jetstream(), NODE) == []  # nothing minted for the node


async def test_a_deploy_of_an_allocation_already_ended_fails_with_the_authoritys_reason(
    pool: asyncpg.Pool,
    sim: tuple[object, int],
    server: NatsServer,
    tls_files: TlsFiles,
    authority: Authority,
    admin: nats.NATS,
    tmp_path: Path,
) -> None:
    """The allocation's users were revoked (its release) before the deploy's mint: the command, however recent, gets
    it no host user. The deploy fails at once with the reason, and MAAS is never called."""
    state, port = sim
    seq = await allocators_deploy(server, tls_files, authority)
    with authority_process(authority, tls_files, server.url, tmp_path / "authority") as url:
        client = gateway_client(authority, tls_files, url, tmp_path)
        assert await client.revoke_allocation(ALLOCATION) == 0  # as the release asks it
        row = await run_deploy(pool, port, client, seq)

    assert (row["state"], row["maas_calls"], row["reason_code"]) == ("failed", 0, "allocation_ended")
    assert ALLOCATION in row["status_message"]
    assert state.call_count("deploy", system_id_for(MACHINE)) == 0  # type: ignore[attr-defined]
    assert await node_users(admin.jetstream(), NODE) == []  # nothing minted for the node


async def test_a_deploy_asked_again_mints_for_its_newest_command(
    pool: asyncpg.Pool,
    sim: tuple[object, int],
    server: NatsServer,
    tls_files: TlsFiles,
    authority: Authority,
    admin: nats.NATS,
    tmp_path: Path,
) -> None:
    """The allocator asks an open deploy again while it waits, and the gateway keeps the newest asking's place in the
    stream: a deploy whose first command is past the authority's age limit still mints, from the newer one. A late
    redelivery of the older asking never moves it back."""
    state, port = sim
    settings = gateway_settings(port)
    with authority_process(authority, tls_files, server.url, tmp_path / "authority", deploy_command_max_age_s=3) as url:
        first = await allocators_deploy(server, tls_files, authority)
        await record_deploy(pool, settings, "deploy-1", first)
        stored = await admin.jetstream().get_msg("MAAS", first)
        assert stored.time is not None
        # What this waits for is the wall clock itself (the first command older than the limit), no event.
        await asyncio.sleep(max(0.0, (stored.time + timedelta(seconds=3.2) - datetime.now(UTC)).total_seconds()))
        again = await allocators_deploy(server, tls_files, authority)
        await record_deploy(pool, settings, "deploy-1", again)
        await record_deploy(pool, settings, "deploy-1", first)
        params = await pool.fetchval("SELECT params FROM maas_operations WHERE operation_id = 'deploy-1'")
        assert json.loads(params)["command_seq"] == again
        row = await step_deploy(pool, port, gateway_client(authority, tls_files, url, tmp_path))

    assert (row["state"], row["maas_calls"], row["reason_code"]) != ("failed", 0, "deploy_command_expired"), row
    assert row["maas_calls"] == 1, row
    assert state.call_count("deploy", system_id_for(MACHINE)) == 1  # type: ignore[attr-defined]
    assert len(await node_users(admin.jetstream(), NODE)) == 1


async def test_host_users_are_recorded_by_compare_and_set(admin: nats.NATS) -> None:
    js = admin.jetstream()
    await asyncio.gather(*(record_host_users(js, NODE, [f"U{i}"]) for i in range(6)))
    assert sorted(await host_users(js, NODE)) == [f"U{i}" for i in range(6)]
    assert await host_users(js, "never-onboarded") == []


def test_admin_lives_hours_and_no_user_outlives_the_ledger(authority: Authority) -> None:
    admin = authority.issue_user(ADMIN, ROLE_PERMISSIONS[ADMIN])
    lifetime = int(admin.claims["exp"]) - int(admin.claims["iat"])
    assert lifetime <= ADMIN_USER_TTL_S <= 24 * 3600
    with pytest.raises(ValueError, match="at most"):
        authority.issue_host("long", ttl_s=MAX_USER_TTL_S + 86400)
