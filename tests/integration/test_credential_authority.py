"""The credential authority (issue 24, point 2): the one process holding the signing keys, asked over HTTPS with
requests signed by the caller's own bus identity. Against a real nats-server in operator mode with TLS and the
authority as its own process (`gpuaas-credential-authority`).

- The gateway gets a baremetal host's user for an allocation and can end it, through the authority only: the
  gateway's identity can no longer touch the identity ledger, and it holds no key.
- Every refusal is named: unsigned, foreign-signed, another role, replayed, altered, revoked or expired caller;
  nothing is minted, the refusal is logged once without the JWT, and the authority keeps serving.
- The system-account users the authority mints for a push may read and replace account JWTs and nothing else.
- A host user is minted only for what a deploy command on the bus asks (issue 38, point 4): the request names the
  command's MAAS stream sequence, and the authority reads it itself. A mint for another node, another allocation,
  from the wrong producer, for a release command, a made-up sequence or an old command is refused with its code,
  logged once, and writes nothing to the ledger.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import nats
import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from gpuaas_common.identity import Authority, Creds
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.authority import (
    ENDED_ALLOCATIONS_KEY,
    HOST_USER_TTL_S,
    allocation_users,
    ended_allocations,
    host_users,
    live_node_users,
    node_users,
    record_host_users,
    revoked_users,
)
from gpuaas_common.identity.permissions import ADMIN, AUTHORITY, ROLE_PERMISSIONS
from gpuaas_common.identity.rotation import host_files
from gpuaas_common.identity.signed_request import HEADER, sign
from gpuaas_common.identity.tls import TlsFiles, client_context
from gpuaas_common.jetstream import IDENTITY_BUCKET, provision
from gpuaas_credential_authority.adapters.deploy_commands import DeployCommands
from gpuaas_credential_authority.adapters.ledger import Ledger
from gpuaas_credential_authority.domain.deploy_commands import DeployCommandRefused
from gpuaas_credential_authority.domain.grants import HostUserGrant
from gpuaas_credential_authority.service_layer.host_users import HostUsers
from gpuaas_dev.testing.nats_clients import connect_as
from gpuaas_dev.testing.servers import NatsServer
from gpuaas_maas_gateway.adapters.credential_authority import AuthorityClient, AuthorityRefused

from .authority_process import authority_process, log_of
from .deploy_commands import Deploys

NODE = "bm:01"


@pytest.fixture
def authority() -> Authority:
    return Authority.create()


@pytest.fixture
def server(tmp_path: Path, authority: Authority, tls_files: TlsFiles) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path / "nats", auth=authority, tls=tls_files).start()
    yield srv
    srv.stop()


async def connect(server: NatsServer, tls_files: TlsFiles, creds: Creds, **kw: object) -> nats.NATS:
    return await connect_as(server.url, tls_files.ca, creds, **kw)


@pytest_asyncio.fixture
async def admin(server: NatsServer, tls_files: TlsFiles, authority: Authority) -> AsyncIterator[nats.NATS]:
    nc = await connect(server, tls_files, authority.issue_user(ADMIN, ROLE_PERMISSIONS[ADMIN]))
    await provision(nc.jetstream())
    yield nc
    await nc.close()


@pytest_asyncio.fixture
async def deploys(
    admin: nats.NATS, server: NatsServer, tls_files: TlsFiles, authority: Authority
) -> AsyncIterator[Deploys]:
    publishers = await Deploys.connect(server.url, tls_files, authority)
    yield publishers
    await publishers.close()


@pytest.fixture
def authority_url(
    admin: nats.NATS, server: NatsServer, tls_files: TlsFiles, authority: Authority, tmp_path: Path
) -> Iterator[str]:
    with authority_process(authority, tls_files, server.url, tmp_path / "authority") as url:
        yield url


@dataclass(frozen=True)
class Bench:
    """What the tests of the authority as the gateway asks it share: the bus, its keys, the authority's process, the
    allocator's and the scheduler's deploy commands."""

    url: str
    authority: Authority
    server: NatsServer
    tls_files: TlsFiles
    admin: nats.NATS
    deploys: Deploys
    tmp_path: Path

    @property
    def js(self) -> JetStreamContext:
        return self.admin.jetstream()

    def client(self) -> AuthorityClient:
        """The gateway's client, signing with a gateway identity of its own."""
        return AuthorityClient(self.url, str(self.tls_files.ca), str(gateway_creds(self.authority, self.tmp_path)))

    def refusals(self) -> list[str]:
        """The reason of each refusal the authority logged, in order."""
        log = log_of(self.tmp_path / "authority")
        return [json.loads(line)["reason"] for line in log.splitlines() if '"authority_request_refused"' in line]


@pytest.fixture
def bench(
    authority_url: str,
    authority: Authority,
    server: NatsServer,
    tls_files: TlsFiles,
    admin: nats.NATS,
    deploys: Deploys,
    tmp_path: Path,
) -> Bench:
    return Bench(authority_url, authority, server, tls_files, admin, deploys, tmp_path)


def gateway_creds(authority: Authority, tmp_path: Path, role: str = "maas-gateway", **kw: float) -> Path:
    return creds_files.write(
        tmp_path / f"{role}-{uuid.uuid4().hex[:6]}.creds", authority.issue_user(role, ROLE_PERMISSIONS[role], **kw)
    )


async def test_the_gateway_mints_and_ends_a_baremetal_hosts_user_through_the_authority(bench: Bench) -> None:
    client = bench.client()
    allocation = str(uuid.uuid4())

    minted = await client.mint(
        NODE, allocation, ttl_s=3600, deploy_command_seq=await bench.deploys.tenant(NODE, allocation)
    )

    host = creds_files.parse(minted.creds)
    assert host.claims["sub"] == minted.user
    assert f"allocation:{allocation}" in host.claims["nats"]["tags"] and f"node:{NODE}" in host.claims["nats"]["tags"]
    assert (
        host.claims["iss"] == bench.authority.baremetal_signing.public
    )  # the baremetal key: its template, nothing more
    assert await allocation_users(bench.js, allocation) == [minted.user]  # recorded before it left
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    conn = await connect(bench.server, bench.tls_files, host, closed_cb=on_closed)
    assert await client.revoke_allocation(allocation) == 1
    await asyncio.wait_for(closed.wait(), timeout=5)  # its live connection ends with the revocation
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await connect(bench.server, bench.tls_files, host)
    assert conn.is_closed
    assert await client.revoke_allocation(allocation) == 0  # nothing left: nothing pushed again


async def test_a_slice_hosts_identity_ends_through_the_authority(
    authority_url: str, authority: Authority, server: NatsServer, tls_files: TlsFiles, admin: nats.NATS, tmp_path: Path
) -> None:
    slice_creds, neighbour = authority.issue_host(NODE), authority.issue_host("slice-02")
    for node in (NODE, "slice-02"):
        await record_host_users(admin.jetstream(), node, authority.issued_hosts[node])  # as onboarding does
    client = AuthorityClient(authority_url, str(tls_files.ca), str(gateway_creds(authority, tmp_path)))

    assert await client.end_slice_identity(NODE) == 1

    with pytest.raises(Exception, match="(?i)authorization violation"):
        await connect(server, tls_files, slice_creds)
    other = await connect(server, tls_files, neighbour)
    await other.close()
    assert await client.end_slice_identity(NODE) == 0


async def test_a_redeployed_slice_host_gets_a_slice_hosts_own_user_which_ends_like_an_onboarded_ones(
    bench: Bench,
) -> None:
    """The scheduler's walk redeploys a converting host with the slice-host profile: its user is a slice host's (no
    allocation, the host lifetime, recorded as the host's), so renewal takes it like an onboarded host's file and
    the host's slice identity ends with it before a tenant's deploy."""
    client = bench.client()

    walk = str(uuid.uuid4())

    minted = await client.mint_slice_host(NODE, walk, deploy_command_seq=await bench.deploys.walk(NODE, walk))

    host = creds_files.parse(minted.creds)
    tags = host.claims["nats"]["tags"]
    assert f"node:{NODE}" in tags and not [t for t in tags if t.startswith("allocation:")]
    assert host.claims["exp"] - host.claims["iat"] == HOST_USER_TTL_S
    assert await host_users(bench.js, NODE) == [minted.user]
    path = creds_files.write(bench.tmp_path / "hosts" / f"node-{NODE}.creds", host)
    assert host_files(bench.tmp_path / "hosts") == {NODE: path}  # renewed as a slice host's
    conn = await connect(bench.server, bench.tls_files, host)
    await conn.close()
    assert await client.end_slice_identity(NODE) == 1
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await connect(bench.server, bench.tls_files, host)


async def test_no_second_live_user_is_minted_for_a_node_until_its_users_are_ended(bench: Bench) -> None:
    """Issue 38 (N4): a node has one live host user at most. Before, the authority minted another user for any
    node the gateway named, beside the one the host runs with (a compromised gateway became that host). The
    gateway's flow keeps working: it ends the node's users before each deploy, and the deploy's mint follows."""
    client = bench.client()
    js = bench.js
    first, second, third, walk = (str(uuid.uuid4()) for _ in range(4))
    first_seq, second_seq, walk_seq = (
        await bench.deploys.tenant(NODE, first),
        await bench.deploys.tenant(NODE, second),
        await bench.deploys.walk(NODE, walk),
    )
    minted = await client.mint(NODE, first, ttl_s=3600, deploy_command_seq=first_seq)

    with pytest.raises(AuthorityRefused, match="409 node_has_live_user"):
        await client.mint(NODE, second, ttl_s=3600, deploy_command_seq=second_seq)  # another allocation on the node
    with pytest.raises(AuthorityRefused, match="409 node_has_live_user"):
        await client.mint(NODE, first, ttl_s=3600, deploy_command_seq=first_seq)  # a second user beside the first
    with pytest.raises(AuthorityRefused, match="409 node_has_live_user"):
        await client.mint_slice_host(NODE, walk, deploy_command_seq=walk_seq)  # a slice host's user on the node
    assert await allocation_users(js, second) == [] and await allocation_users(js, first) == [minted.user]
    assert await host_users(js, NODE) == []  # nothing minted by a refused one

    # An onboarded slice host's user (recorded by onboarding, not by the authority) counts too.
    onboarded = bench.authority.issue_host("slice-03")
    await record_host_users(js, "slice-03", [str(onboarded.claims["sub"])])
    with pytest.raises(AuthorityRefused, match="409 node_has_live_user"):
        await client.mint(
            "slice-03", third, ttl_s=3600, deploy_command_seq=await bench.deploys.tenant("slice-03", third)
        )

    # Revoke, then mint: the gateway's deploy ends the node's users (the tenant's from the earlier deploy too).
    assert await client.end_slice_identity(NODE) == 1
    again = await client.mint(NODE, second, ttl_s=3600, deploy_command_seq=second_seq)
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await connect(bench.server, bench.tls_files, creds_files.parse(minted.creds))
    conn = await connect(bench.server, bench.tls_files, creds_files.parse(again.creds))
    await conn.close()
    assert await client.revoke_allocation(second) == 1  # the release ends it; the next deploy mints again
    await client.mint_slice_host(NODE, walk, deploy_command_seq=walk_seq)
    assert bench.refusals() == ["node_has_live_user"] * 4


async def test_a_host_user_is_minted_only_for_the_deploy_command_that_asks_for_it(bench: Bench) -> None:
    """Issue 38 (point 4): before, the authority minted a host user for whatever node and allocation the gateway
    named, so a compromised gateway could become any machine's host. Now the request names a deploy command by
    its MAAS stream sequence, and the authority reads that command itself: only the allocator's deploy of that
    node for that allocation gives a tenant's host user, only the scheduler's slice-host redeploy of that node in
    that walk a slice host's."""
    client = bench.client()
    js = bench.js
    allocation, other_allocation, walk, other_walk = (str(uuid.uuid4()) for _ in range(4))
    tenant_seq = await bench.deploys.tenant(NODE, allocation)
    walk_seq = await bench.deploys.walk(NODE, walk)
    release_seq = await bench.deploys.release(NODE, allocation)
    refused: dict[str, tuple[Callable[[], Awaitable[object]], str]] = {
        "another node": (
            lambda: client.mint("bm:02", allocation, 3600, deploy_command_seq=tenant_seq),
            "deploy_command_mismatch",
        ),
        "another allocation": (
            lambda: client.mint(NODE, other_allocation, 3600, deploy_command_seq=tenant_seq),
            "deploy_command_mismatch",
        ),
        "a host user for the scheduler's walk": (
            lambda: client.mint(NODE, walk, 3600, deploy_command_seq=walk_seq),
            "deploy_command_mismatch",
        ),
        "a slice host's user for the allocator's deploy": (
            lambda: client.mint_slice_host(NODE, allocation, deploy_command_seq=tenant_seq),
            "deploy_command_mismatch",
        ),
        "a slice host's user for another walk": (
            lambda: client.mint_slice_host(NODE, other_walk, deploy_command_seq=walk_seq),
            "deploy_command_mismatch",
        ),
        "a release command": (
            lambda: client.mint(NODE, allocation, 3600, deploy_command_seq=release_seq),
            "no_deploy_command",
        ),
        "a made-up sequence": (
            lambda: client.mint(NODE, allocation, 3600, deploy_command_seq=release_seq + 1000),
            "no_deploy_command",
        ),
    }
    for case, (mint, code) in refused.items():
        with pytest.raises(AuthorityRefused) as refusal:
            await mint()
        assert (refusal.value.status, refusal.value.code) == (403, code), case

    for node in (NODE, "bm:02"):  # nothing claimed, nothing recorded
        assert await node_users(js, node) == [] and await host_users(js, node) == []
    for aggregate in (allocation, other_allocation, walk, other_walk):
        assert await allocation_users(js, aggregate) == []
    assert bench.refusals() == [code for _, code in refused.values()]  # each logged once

    # The command that asks for it mints (the node was claimed by none of the refused ones).
    minted = await client.mint(NODE, allocation, 3600, deploy_command_seq=tenant_seq)
    assert await allocation_users(js, allocation) == [minted.user]
    assert await node_users(js, NODE) == [minted.user]


async def ledger_entries(js: JetStreamContext) -> dict[str, tuple[bytes | None, int | None]]:
    """Every entry of the identity ledger as it stands (value, revision)."""
    kv = await js.key_value(IDENTITY_BUCKET)
    entries = {}
    for key in await kv.keys():
        entry = await kv.get(key)
        entries[key] = (entry.value, entry.revision)
    return entries


async def test_a_released_allocations_deploy_command_mints_it_no_host_user_again(bench: Bench) -> None:
    """Issue 38: before, the deploy command named again within its age limit gave the allocation a host user after
    its release had revoked the last one (once the node's claim was free). Now the release ends the allocation in
    the ledger, and its mint is refused with nothing written. The gateway's retries of a deploy still mint: each
    ends the node's users first, which ends no allocation."""
    client, js = bench.client(), bench.js
    allocation = str(uuid.uuid4())
    seq = await bench.deploys.tenant(NODE, allocation)
    first = await client.mint(NODE, allocation, 3600, deploy_command_seq=seq)
    # The deploy tried again (its first try never reached MAAS): the node's users end, the same command mints.
    assert await client.end_slice_identity(NODE) == 1
    retried = await client.mint(NODE, allocation, 3600, deploy_command_seq=seq)
    assert sorted(await allocation_users(js, allocation)) == sorted([first.user, retried.user])
    assert await ended_allocations(js) == {}

    assert await client.revoke_allocation(allocation) == 1  # the release
    assert list(await ended_allocations(js)) == [allocation]
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await connect(bench.server, bench.tls_files, creds_files.parse(retried.creds))
    before = await ledger_entries(js)
    with pytest.raises(AuthorityRefused) as refusal:
        await client.mint(NODE, allocation, 3600, deploy_command_seq=seq)
    assert (refusal.value.status, refusal.value.code) == (403, "allocation_ended")
    assert await ledger_entries(js) == before  # nothing claimed, nothing recorded, nothing revoked
    assert bench.refusals() == ["allocation_ended"]  # logged once
    # Refused for the allocation's end, not the node's: the node's next allocation mints.
    following = str(uuid.uuid4())
    await client.mint(NODE, following, 3600, deploy_command_seq=await bench.deploys.tenant(NODE, following))


async def test_a_revoke_with_no_user_left_still_ends_the_allocation_and_old_ends_are_pruned(bench: Bench) -> None:
    """A revoke ends the allocation even when it finds nothing to revoke (a deploy that failed before its mint). The
    marks it keeps are the allocations ended within the command age limit (its default here) and a margin: an older one
    refuses nothing an old command's refusal would not, so it goes at the next revoke."""
    client, js = bench.client(), bench.js
    allocation, long_ago, lately = (str(uuid.uuid4()) for _ in range(3))
    seq = await bench.deploys.tenant(NODE, allocation)
    kv = await js.key_value(IDENTITY_BUCKET)
    now = int(time.time())
    await kv.put(ENDED_ALLOCATIONS_KEY, json.dumps({long_ago: now - 4 * 3600, lately: now - 30 * 60}).encode())

    assert await client.revoke_allocation(allocation) == 0

    assert set(await ended_allocations(js)) == {lately, allocation}
    with pytest.raises(AuthorityRefused, match="403 allocation_ended"):
        await client.mint(NODE, allocation, 3600, deploy_command_seq=seq)
    assert await node_users(js, NODE) == [] and await allocation_users(js, allocation) == []


class ReleasedMeanwhile(Ledger):
    """The ledger, with the allocation's release run between a mint's check of the allocation and its record of
    the user: another replica serving the release while this one mints."""

    release: Callable[[], Awaitable[int]]
    released: int | None = None

    async def record_allocation_user(self, allocation_id: str, user: str, expires_at: int) -> None:
        self.released = await self.release()
        await super().record_allocation_user(allocation_id, user, expires_at)


async def test_a_mint_that_a_release_overtakes_revokes_its_own_user(bench: Bench) -> None:
    """The release marks the allocation ended before it reads the allocation's users; the mint reads the mark
    again once its user is recorded. So one of them sees the other: here the release found no user yet, and the
    mint revokes the user it had not handed out, and is refused."""
    allocation = str(uuid.uuid4())
    seq = await bench.deploys.tenant(NODE, allocation)
    nc = await connect(
        bench.server, bench.tls_files, bench.authority.issue_user(AUTHORITY, ROLE_PERMISSIONS[AUTHORITY])
    )
    try:
        ledger = ReleasedMeanwhile(nc.jetstream(), [bench.server.url], client_context(bench.tls_files.ca))
        service = HostUsers(bench.authority, ledger, DeployCommands(nc.jetstream()), max_command_age_s=3600)
        ledger.release = lambda: service.revoke_allocation(allocation, "maas-gateway")
        with pytest.raises(DeployCommandRefused) as refused:
            await service.mint(HostUserGrant(NODE, allocation, 3600, seq), "maas-gateway")
    finally:
        await nc.close()
    assert refused.value.code == "allocation_ended"
    assert ledger.released == 0  # the release came before the user was recorded
    [user] = await allocation_users(bench.js, allocation)
    assert user in await revoked_users(bench.js)
    assert await live_node_users(bench.js, NODE) == []  # the node is free


async def test_an_old_deploy_command_mints_nothing(
    server: NatsServer, authority: Authority, tls_files: TlsFiles, admin: nats.NATS, deploys: Deploys, tmp_path: Path
) -> None:
    """A deploy's user-data is minted soon after its command: one named long after is a replay."""
    js = admin.jetstream()
    with authority_process(authority, tls_files, server.url, tmp_path / "authority", deploy_command_max_age_s=1) as url:
        client = AuthorityClient(url, str(tls_files.ca), str(gateway_creds(authority, tmp_path)))
        allocation = str(uuid.uuid4())
        seq = await deploys.tenant(NODE, allocation)
        stored = await js.get_msg("MAAS", seq)
        assert stored.time is not None
        # What this waits for is the wall clock itself (the command older than the authority's limit), no event.
        await asyncio.sleep(max(0.0, (stored.time + timedelta(seconds=1.5) - datetime.now(UTC)).total_seconds()))
        with pytest.raises(AuthorityRefused, match="403 deploy_command_expired"):
            await client.mint(NODE, allocation, 3600, deploy_command_seq=seq)
    assert await node_users(js, NODE) == [] and await allocation_users(js, allocation) == []


async def test_the_authority_reads_a_maas_message_by_its_sequence_and_nothing_more_of_the_bus(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS, deploys: Deploys
) -> None:
    """Its one right beyond the ledger: no other stream's messages, no command of its own on the MAAS subjects."""
    seq = await deploys.tenant(NODE, str(uuid.uuid4()))
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await connect(
        server, tls_files, authority.issue_user(AUTHORITY, ROLE_PERMISSIONS[AUTHORITY]), error_cb=on_error
    )
    try:
        js = nc.jetstream(timeout=1)
        assert (await js.get_msg("MAAS", seq)).subject == "gpuaas.maas.command.deploy"
        # Refused by the server (a permissions violation, reported asynchronously), so nothing answers.
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
            await js.get_msg("ALLOCATIONS", 1)
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
            await js.publish("gpuaas.maas.command.deploy", b"{}", timeout=1)
        await nc.flush()
    finally:
        await nc.close()
    violations = [e for e in errors if "permissions violation" in str(e).lower()]
    assert len(violations) == 2, errors


async def _post(url: str, path: str, body: bytes, header: str | None, tls_files: TlsFiles) -> tuple[int, dict]:
    headers = {HEADER: header} if header else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, data=body, headers=headers, ssl=client_context(tls_files.ca)) as resp:
            return resp.status, await resp.json(content_type=None)


async def test_every_refusal_is_named_nothing_is_minted_and_the_authority_keeps_serving(bench: Bench) -> None:
    allocation = str(uuid.uuid4())
    path = "/v1/host-users"
    seq = await bench.deploys.tenant(NODE, allocation)
    body = json.dumps({"node_id": NODE, "allocation_id": allocation, "ttl_s": 600, "deploy_command_seq": seq}).encode()
    gateway = creds_files.read(gateway_creds(bench.authority, bench.tmp_path))
    revoked = bench.authority.issue_user("maas-gateway", ROLE_PERMISSIONS["maas-gateway"])
    await bench.authority.issuer().revoke(
        [bench.server.url], [str(revoked.claims["sub"])], js=bench.js, tls=client_context(bench.tls_files.ca)
    )
    first = sign(gateway, "POST", path, body)
    status, answer = await _post(bench.url, path, body, first, bench.tls_files)
    assert status == 201
    minted = answer["user"]
    stranger = Authority.create().issue_user("maas-gateway", ROLE_PERMISSIONS["maas-gateway"])
    scheduler = bench.authority.issue_user("scheduler", ROLE_PERMISSIONS["scheduler"])
    expired = bench.authority.issue_user("maas-gateway", ROLE_PERMISSIONS["maas-gateway"], ttl_s=-10)
    altered = json.dumps(
        {"node_id": "slice-09", "allocation_id": allocation, "ttl_s": 600, "deploy_command_seq": seq}
    ).encode()
    cases: dict[str, tuple[bytes, str | None]] = {
        "unsigned": (body, None),
        "foreign_jwt": (body, sign(stranger, "POST", path, body)),
        "not_allowed": (body, sign(scheduler, "POST", path, body)),
        "replayed": (body, first),
        "bad_signature": (altered, sign(gateway, "POST", path, body)),
        "expired": (body, sign(expired, "POST", path, body)),
        "revoked": (body, sign(revoked, "POST", path, body)),
        "stale": (body, sign(gateway, "POST", path, body, now=1_000_000_000)),
    }
    for reason, (sent, header) in cases.items():
        status, answer = await _post(bench.url, path, sent, header, bench.tls_files)
        assert (status, answer["error"]["code"]) == (403 if reason == "not_allowed" else 401, reason), answer

    assert await allocation_users(bench.js, allocation) == [minted]  # nothing minted by a refused one
    # And it keeps serving (another node: this one has its live user, issue 38).
    other_allocation = str(uuid.uuid4())
    other_seq = await bench.deploys.tenant("bm:02", other_allocation)
    other = json.dumps(
        {"node_id": "bm:02", "allocation_id": other_allocation, "ttl_s": 600, "deploy_command_seq": other_seq}
    ).encode()
    status, _ = await _post(bench.url, path, other, sign(gateway, "POST", path, other), bench.tls_files)
    assert status == 201
    assert sorted(bench.refusals()) == sorted(cases)  # each logged once
    log = log_of(bench.tmp_path / "authority")
    for creds in (gateway, stranger, scheduler, expired, revoked):
        assert creds.jwt not in log and creds.seed.decode() not in log


async def test_bad_grants_are_refused_with_the_field_named(
    authority_url: str, authority: Authority, tls_files: TlsFiles, deploys: Deploys, tmp_path: Path
) -> None:
    """Refused before the bus is read: a request that could not name a host user names no deploy either."""
    client = AuthorityClient(authority_url, str(tls_files.ca), str(gateway_creds(authority, tmp_path)))
    seq = await deploys.tenant(NODE, str(uuid.uuid4()))
    for node, allocation, field in (
        ("a.b", str(uuid.uuid4()), "node_id"),  # a '.' would split the host template's subject tokens
        ("*", str(uuid.uuid4()), "node_id"),
        (NODE, "not-a-uuid", "allocation_id"),
    ):
        with pytest.raises(AuthorityRefused, match=f"400 invalid: {field}"):
            await client.mint(node, allocation, ttl_s=600, deploy_command_seq=seq)
    with pytest.raises(AuthorityRefused, match="400 invalid: ttl_s"):
        await client.mint(NODE, str(uuid.uuid4()), ttl_s=1, deploy_command_seq=seq)
    with pytest.raises(AuthorityRefused, match="400 invalid: deploy_command_seq"):
        await client.mint(NODE, str(uuid.uuid4()), ttl_s=600, deploy_command_seq=0)
    with pytest.raises(AuthorityRefused, match="400 invalid: walk_id"):
        await client.mint_slice_host(NODE, "walk-1", deploy_command_seq=seq)


async def test_a_minted_lifetime_is_capped_whatever_the_caller_asks(
    authority_url: str, authority: Authority, tls_files: TlsFiles, deploys: Deploys, tmp_path: Path
) -> None:
    client = AuthorityClient(authority_url, str(tls_files.ca), str(gateway_creds(authority, tmp_path)))
    allocation = str(uuid.uuid4())
    seq = await deploys.tenant(NODE, allocation)
    minted = await client.mint(NODE, allocation, ttl_s=10 * 365 * 86400, deploy_command_seq=seq)
    claims = creds_files.parse(minted.creds).claims
    assert claims["exp"] - claims["iat"] <= 7 * 86400


async def test_the_gateway_can_no_longer_write_the_identity_ledger(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS
) -> None:
    """Before, the gateway kept the revocation ledger itself: it could drop a revocation or pre-empt one."""
    gw = await connect(server, tls_files, authority.issue_user("maas-gateway", ROLE_PERMISSIONS["maas-gateway"]))
    try:
        # Refused at the bucket's info already (no STREAM.INFO right), or at the write.
        with pytest.raises((nats.errors.Error, nats.js.errors.Error)):
            kv = await gw.jetstream().key_value(IDENTITY_BUCKET)
            await kv.put("revocations", b"{}")
    finally:
        await gw.close()
    assert await revoked_users(admin.jetstream()) == {}  # nothing written


async def test_the_system_user_may_replace_account_jwts_and_nothing_else(
    server: NatsServer, tls_files: TlsFiles, authority: Authority
) -> None:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    sys_creds = authority.issue_sys_user()
    nc = await connect(server, tls_files, sys_creds, error_cb=on_error, inbox_prefix=b"_INBOX_authority")
    try:
        lookup = await nc.request(f"$SYS.REQ.ACCOUNT.{authority.account.public}.CLAIMS.LOOKUP", b"", timeout=5)
        assert lookup.data.startswith(b"eyJ")
        # Refused by the server (a permissions violation, reported asynchronously), so no server answers.
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
            await nc.request("$SYS.REQ.SERVER.PING", b"", timeout=1)
        await nc.flush()
    finally:
        await nc.close()
    assert any("permissions violation" in str(e).lower() for e in errors), errors
    assert int(sys_creds.claims["exp"]) - int(sys_creds.claims["iat"]) <= 3600
