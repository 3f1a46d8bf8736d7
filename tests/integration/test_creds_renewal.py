"""Credentials renewed before they expire, taken up live with no gap (issue 24, point 5), against a real
nats-server in operator mode with TLS.

A service (a real `ServiceRuntime`, as the MAAS gateway's identity) is given creds that live seconds; it
consumes commands and publishes a result for each, while the issuer rewrites its creds file at half-life
(`identity.rotation`, as `gpuaas identities renew` does). Past the old creds' expiry — which the server
enforces: a control connection holding them is closed then — every command was handled once (none lost, none
redelivered), every result published without an error, and the service's connection never closed. The same
for a slice host's link, whose renewed user is recorded on the bus; a host whose user was revoked (it left
slice mode) is not renewed; and a renewed file the server refuses never costs the working session.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import RawCredentials

from gpuaas_common.bus import HandlerContext, parse_message
from gpuaas_common.bus_gate import TrafficGate
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.messages import MaasTagsSyncResult
from gpuaas_common.creds_renewal import CredsRenewal
from gpuaas_common.identity import Authority, Creds
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.authority import host_users, record_host_users
from gpuaas_common.identity.permissions import ADMIN, ROLE_PERMISSIONS
from gpuaas_common.identity.rotation import renew_host_files, renew_role_files, renewal_due
from gpuaas_common.identity.tls import TlsFiles, client_context, client_tls_options
from gpuaas_common.jetstream import CONSUMER_BY_NAME, node_agent_consumer, provision
from gpuaas_common.natsconn import NatsIdentity
from gpuaas_common.runtime import ServiceRuntime
from gpuaas_common.settings import ServiceSettings
from gpuaas_dev.testing.servers import NatsServer
from gpuaas_dev.testing.waiting import eventually
from gpuaas_node_agent.adapters.host_link import HostLink

SERVICE = "maas-gateway"
COMMAND = "maas.tags_sync_requested"
RESULT = "maas.tags_sync_result"
SHORT_TTL_S = 4.0  # the old creds: renewal due after 2 s, expired after 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, authority: Authority, tls_files: TlsFiles) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats-renewal"), auth=authority, tls=tls_files).start()
    yield srv
    srv.stop()


async def _connect(server: NatsServer, tls_files: TlsFiles, creds: Creds, **kw: Any) -> nats.NATS:
    return await nats.connect(
        server.url,
        user_credentials=RawCredentials(creds.render()),
        **client_tls_options(tls_files.ca),
        inbox_prefix=f"_INBOX_{creds.name}".encode(),
        allow_reconnect=False,
        connect_timeout=5,
        **kw,
    )


@pytest.fixture
async def admin(server: NatsServer, tls_files: TlsFiles, authority: Authority) -> AsyncIterator[nats.NATS]:
    nc = await _connect(server, tls_files, authority.issue_user(ADMIN, ROLE_PERMISSIONS[ADMIN]))
    await provision(nc.jetstream(), [CONSUMER_BY_NAME["maas-gateway-commands"], node_agent_consumer("r1")])
    yield nc
    await nc.close()


async def _expired_control(server: NatsServer, tls_files: TlsFiles, creds: Creds) -> tuple[nats.NATS, list[float]]:
    """A connection holding the old creds: the server ends it at their expiry, which shows it is real."""
    closed_at: list[float] = []

    async def on_error(exc: Exception) -> None:
        pass  # the server's EOF at the expiry

    async def on_closed() -> None:
        closed_at.append(time.time())

    return await _connect(server, tls_files, creds, error_cb=on_error, closed_cb=on_closed), closed_at


def _command(n: int) -> bytes:
    payload = {"operation_id": f"op-{n:05d}", "site": "s1", "profile": "p1"}
    env = Envelope.wrap(COMMAND, payload, producer="test", correlation_id=f"c-{n}")
    return env.model_dump_json().encode()


async def test_a_service_renews_its_creds_before_expiry_and_loses_nothing(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS, tmp_path: Path
) -> None:
    creds_dir = tmp_path / "creds"
    old = authority.issue_user(SERVICE, ROLE_PERMISSIONS[SERVICE], ttl_s=SHORT_TTL_S)
    creds_files.write(creds_dir / f"{SERVICE}.creds", old)
    control, control_closed_at = await _expired_control(server, tls_files, old)
    settings = ServiceSettings(
        nats_url=server.url,
        nats_creds=str(creds_dir / f"{SERVICE}.creds"),
        nats_ca_file=str(tls_files.ca),
        nats_creds_check_interval_s=0.05,
    )
    rt = ServiceRuntime(SERVICE, settings)
    handled: dict[str, int] = {}  # operation id -> deliveries seen
    publish_errors: list[str] = []

    async def on_command(ctx: HandlerContext) -> None:
        op = ctx.payload.operation_id
        handled[op] = handled.get(op, 0) + ctx.num_delivered
        try:  # the service's own publish, for each command, across the switch
            await rt.bus.publish(  # type: ignore[union-attr]
                RESULT,
                MaasTagsSyncResult(
                    operation_id=op, site="s1", status="succeeded", resolution="direct", attempts=1, profile="p1"
                ),
                correlation_id=ctx.envelope.correlation_id,
            )
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            publish_errors.append(repr(exc))

    results: list[str] = []

    async def on_result(msg: Any) -> None:
        results.append(Envelope.model_validate_json(msg.data).payload["operation_id"])

    await admin.subscribe(spec_for(RESULT).subject(), cb=on_result)
    await rt.setup()
    rt.bus.subscribe(  # type: ignore[union-attr]
        CONSUMER_BY_NAME["maas-gateway-commands"], {COMMAND: on_command}, transactional=False, concurrency=4
    )
    await rt.start()
    # What the reconnect found: by construction nothing JetStream owes the service may be in flight then.
    at_switch: list[tuple[bool, int, list[Any]]] = []
    nc, force_reconnect = rt.nc, rt.nc.force_reconnect  # type: ignore[union-attr]
    gate, loops = rt.bus.gate, rt.bus._loops  # type: ignore[union-attr]

    async def watched_reconnect() -> None:
        at_switch.append((gate.is_open, gate.in_flight, [loop._open for loop in loops]))
        await force_reconnect()

    nc.force_reconnect = watched_reconnect  # type: ignore[union-attr,method-assign]
    sent = 0
    stop = asyncio.Event()

    async def commands() -> None:
        """A steady flow of commands, one every 10 ms, through the renewal and past the old expiry."""
        nonlocal sent
        ajs = admin.jetstream()
        while not stop.is_set():
            await ajs.publish(spec_for(COMMAND).subject(), _command(sent))
            sent += 1
            await asyncio.sleep(0.01)  # the pace of the flow, not a wait for anything

    flow = asyncio.create_task(commands())
    try:
        await _renew_across_the_expiry(rt, authority, creds_dir, control, control_closed_at, server, tls_files)
        after = sent
        await eventually(lambda: sent >= after + 50, what="commands after the expiry")
    finally:
        stop.set()
        await flow
    try:
        ops = {f"op-{n:05d}" for n in range(sent)}
        await eventually(lambda: set(handled) == ops and set(results) >= ops, timeout=15, what="every answer")
        assert rt.nc is not None and rt.nc.is_connected and not rt.nc.is_closed
        assert rt.nc.stats["reconnects"] == 1, "one switch, no other reconnect"
        assert at_switch == [(False, 0, [None])], "the gate closed, no PubAck and no pull request outstanding"
        assert rt.renewal is not None and rt.renewal.renewals == 1
        assert rt.identity.last_refusal is None
        assert publish_errors == []
        assert {op: n for op, n in handled.items() if n != 1} == {}, "redelivered: something was lost in flight"
        assert sorted(results) == sorted(ops), "each result published once"
    finally:
        await rt.stop()


async def _renew_across_the_expiry(
    rt: ServiceRuntime,
    authority: Authority,
    creds_dir: Path,
    control: nats.NATS,
    control_closed_at: list[float],
    server: NatsServer,
    tls_files: TlsFiles,
) -> None:
    """The issuer's periodic run rewrites the file at half-life; the service switches before the old creds
    expire; the server then ends the old creds (the control connection) and refuses them."""
    path = creds_dir / f"{SERVICE}.creds"
    old = creds_files.read(path)
    old_exp = int(old.claims["exp"])
    # The issuer's periodic run: nothing to do before half-life, the file rewritten once it is due.
    assert renew_role_files(authority, creds_dir, ttl_s=3600) == []
    await eventually(lambda: renewal_due(creds_files.read(path)), timeout=10, what="half-life")
    assert renew_role_files(authority, creds_dir, ttl_s=3600) == [SERVICE]
    new_jwt = creds_files.read(path).jwt
    await eventually(lambda: rt.identity.session and rt.identity.session.jwt == new_jwt, what="the switch")
    assert time.time() < old_exp, "switched before the old creds expired"
    # The server ends the old creds at their expiry (the control connection), the service goes on.
    await eventually(lambda: control.is_closed, timeout=10, what="the old creds' expiry")
    assert control_closed_at[0] >= old_exp - 0.5, "the control connection ended at the expiry, not before"
    # The server compares whole seconds: a second later the old creds are refused outright.
    await eventually(lambda: time.time() >= old_exp + 1.1, what="a second past the expiry")
    with pytest.raises(Exception, match="(?i)authorization"):
        await _connect(server, tls_files, old)


async def test_a_slice_host_renews_its_user_on_the_bus_and_keeps_its_durable(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS, tmp_path: Path
) -> None:
    node = "r1"
    path = tmp_path / "node-r1.creds"
    old = authority.issue_host(node, ttl_s=SHORT_TTL_S)
    creds_files.write(path, old)
    ajs = admin.jetstream()
    await record_host_users(ajs, node, [old.claims["sub"]], expiry=authority.host_expiry)
    identity = NatsIdentity([server.url], str(path), str(tls_files.ca), creds_check_interval_s=0.05)
    link = HostLink(node, identity, retry_delays_s=(0.05,))
    bus = await link.open(retry_forever=False)

    async def on_task(ctx: HandlerContext) -> None:
        raise AssertionError("no task is sent here")

    bus.subscribe(node_agent_consumer(node), {"slice.vm_release": on_task}, transactional=False)
    await link.start()
    letters: list[bytes] = []

    async def on_letter(msg: Any) -> None:
        letters.append(msg.data)

    await admin.subscribe(f"gpuaas.node.{node}.report.drift", cb=on_letter)
    try:
        servers = [server.url]
        tls = client_context(tls_files.ca)
        assert await renew_host_files(authority, {node: path}, js=ajs, nats_servers=servers, tls=tls) == {}
        await eventually(lambda: renewal_due(creds_files.read(path)), timeout=10, what="half-life")
        outcome = await renew_host_files(authority, {node: path}, js=ajs, nats_servers=servers, tls=tls, ttl_s=600)
        assert outcome == {node: "renewed"}
        new = creds_files.read(path)
        # Recorded before the file was written: the gateway can end the new user like the old.
        assert new.claims["sub"] in await host_users(ajs, node)
        await eventually(lambda: identity.session and identity.session.jwt == new.jwt, what="the host's switch")
        await eventually(lambda: time.time() > old.claims["exp"] + 1, timeout=10, what="the old user's expiry")
        # Its task durable and its own publishes still work, as the new user: a message that is not JSON is
        # pulled from the durable and held by the host (hosts keep their dead letters at home and count them),
        # and its report goes out on its own subject.
        await ajs.publish(f"gpuaas.node.{node}.tasks.slice.vm_release", b"not json")
        held = bus.held_dead_letters
        assert held is not None
        await eventually(lambda: held.count == 1, what="the host's dead letter, held")
        report = m.NodeDriftReported(node_id=node, checked_at=datetime.now(timezone.utc), dead_lettered=held.count)
        await bus.publish("node.drift_reported", report, correlation_id=node, node_id=node)
        await eventually(lambda: letters, what="the host's report")
        assert parse_message(f"gpuaas.node.{node}.report.drift", letters[0])[1].dead_lettered == 1
        assert link.nc is not None and link.nc.stats["reconnects"] == 1 and not link.nc.is_closed
        # The expired user left the host's entry on the bus: revocations pushed from it stay small.
        assert await host_users(ajs, node) == [new.claims["sub"]]
    finally:
        await link.close()


async def test_a_host_whose_user_was_revoked_is_not_renewed(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS, tmp_path: Path
) -> None:
    """It left slice mode (the gateway ended its identity before a baremetal deploy): only onboarding brings it
    back, never a renewal, which would hand a live slice identity to the tenant's machine."""
    node = f"gone-{uuid.uuid4().hex[:6]}"
    path = tmp_path / f"node-{node}.creds"
    creds = authority.issue_host(node, ttl_s=2)  # due at once
    creds_files.write(path, creds)
    ajs = admin.jetstream()
    await record_host_users(ajs, node, [creds.claims["sub"]], expiry=authority.host_expiry)
    servers, tls = [server.url], client_context(tls_files.ca)
    assert await authority.issuer().end_slice_identity(servers, node, js=ajs, tls=tls) == 1
    assert await renew_host_files(authority, {node: path}, js=ajs, nats_servers=servers, tls=tls) == {node: "revoked"}
    assert creds_files.read(path).jwt == creds.jwt


async def test_a_renewed_file_the_server_refuses_leaves_the_session_working(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS, tmp_path: Path
) -> None:
    path = tmp_path / "ops.creds"
    creds_files.write(path, authority.issue_user("ops", ROLE_PERMISSIONS["ops"], ttl_s=600))
    identity = NatsIdentity([server.url], str(path), str(tls_files.ca), creds_check_interval_s=3600)
    nc = await identity.connect(name="ops-test", retry_forever=False)
    renewal = CredsRenewal(identity, nc, TrafficGate(), name="ops-test")
    try:
        assert await renewal.check() == "unchanged"
        foreign = Authority.create().issue_user("ops", ROLE_PERMISSIONS["ops"])
        creds_files.write(path, foreign)
        assert await renewal.check() == "refused"
        assert await renewal.check() == "unchanged", "judged once per version of the file"
        assert nc.is_connected and nc.stats["reconnects"] == 0
        await nc.flush()
        good = authority.issue_user("ops", ROLE_PERMISSIONS["ops"], ttl_s=600)
        creds_files.write(path, good)
        assert await renewal.check() == "renewed"
        assert identity.session is not None and identity.session.jwt == good.jwt
    finally:
        await nc.close()


async def test_identities_renew_renews_what_is_due_roles_and_hosts(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS, tmp_path: Path
) -> None:
    """The command a deployment runs (compose's `identities-renewer`, with --every)."""
    from typer.testing import CliRunner

    from gpuaas_dev.cli import app

    authority.save(tmp_path / "keys")
    creds_files.write(tmp_path / "creds" / "portal.creds", authority.issue_user("portal", ROLE_PERMISSIONS["portal"]))
    due = authority.issue_user("ops", ROLE_PERMISSIONS["ops"], ttl_s=1)
    creds_files.write(tmp_path / "creds" / "ops.creds", due)
    host = authority.issue_host("cli-1", ttl_s=3)
    creds_files.write(tmp_path / "hosts" / "node-cli-1.creds", host)
    await eventually(lambda: renewal_due(host) and renewal_due(due), what="half-life")
    argv = ["identities", "renew", "--out", str(tmp_path), "--hosts-dir", str(tmp_path / "hosts")]
    argv += ["--nats-url", server.url, "--ca-file", str(tls_files.ca)]
    res = await asyncio.to_thread(CliRunner().invoke, app, argv)
    assert res.exit_code == 0, res.output
    assert "renewed: ops, cli-1" in res.output
    assert creds_files.read(tmp_path / "creds" / "ops.creds").jwt != due.jwt
    renewed_host = creds_files.read(tmp_path / "hosts" / "node-cli-1.creds")
    assert await host_users(admin.jetstream(), "cli-1") == [renewed_host.claims["sub"]]
    assert renewed_host.claims["sub"] in Authority.load(tmp_path / "keys").issued_hosts["cli-1"]
    assert not (tmp_path / "creds" / "admin.creds").exists(), "no admin file is written"


async def test_an_upgraded_deployments_host_gets_a_user_in_the_hosts_account_at_the_first_round(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS, tmp_path: Path
) -> None:
    """Hosts moved to an account of their own (HOSTS, against reply-subject reflection): a host user made before is
    signed for the GPUAAS account, which the servers refuse now. The first renewal round, not half a life later,
    gives the host a user in HOSTS, and the host connects with it."""
    from gpuaas_common.identity.authority import _node_creds

    node = f"old-{uuid.uuid4().hex[:6]}"
    path = tmp_path / f"node-{node}.creds"
    old = _node_creds(authority.node_signing, authority.account.public, node, ttl_s=72 * 3600)  # not due
    creds_files.write(path, old)
    assert not renewal_due(old)
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await _connect(server, tls_files, old)
    ajs = admin.jetstream()
    servers, tls = [server.url], client_context(tls_files.ca)

    assert await renew_host_files(authority, {node: path}, js=ajs, nats_servers=servers, tls=tls) == {node: "renewed"}

    new = creds_files.read(path)
    assert new.claims["nats"]["issuer_account"] == authority.hosts_account.public
    assert new.claims["sub"] in await host_users(ajs, node)
    nc = await _connect(server, tls_files, new)
    await nc.close()
    # Renewed once: the next round finds a user of the right account with its whole life ahead.
    assert await renew_host_files(authority, {node: path}, js=ajs, nats_servers=servers, tls=tls) == {}
