"""A 3-node JetStream cluster in operator mode with TLS on every listener, routes included: streams at R3
keep every acknowledged message through the loss of any one server, clients given all seed URLs carry on
against the survivors, and a restarted server rejoins and catches up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import RawCredentials

from gpuaas_common.identity import Authority, Creds
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS
from gpuaas_common.identity.tls import TlsFiles, client_tls_options
from gpuaas_common.jetstream import CONSUMER_BY_NAME, STREAMS, provision
from gpuaas_dev.testing.servers import NatsCluster
from gpuaas_dev.testing.waiting import eventually

DURABLE = CONSUMER_BY_NAME["allocator-requested"]


@pytest.fixture()
def cluster(
    tmp_path_factory: pytest.TempPathFactory, authority: Authority, tls_files: TlsFiles
) -> Iterator[NatsCluster]:
    c = NatsCluster(tmp_path_factory.mktemp("cluster"), size=3, auth=authority, tls=tls_files).start()
    yield c
    c.stop()


async def connect(cluster: NatsCluster, tls_files: TlsFiles, creds: Creds) -> nats.NATS:
    return await nats.connect(
        servers=cluster.url.split(","),
        user_credentials=RawCredentials(creds.render()),
        **client_tls_options(tls_files.ca),
        inbox_prefix=f"_INBOX_{creds.name}".encode(),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        connect_timeout=5,
    )


async def test_r3_streams_lose_no_acknowledged_message_when_a_server_dies_and_the_dead_one_catches_up(
    cluster: NatsCluster, tls_files: TlsFiles, authority: Authority
) -> None:
    admin = await connect(cluster, tls_files, authority.issue_user("admin", ROLE_PERMISSIONS["admin"]))
    js = admin.jetstream()
    await provision(js, [DURABLE], replicas=3)
    for spec in STREAMS:
        info = await js.stream_info(spec.name)
        assert info.config.num_replicas == 3, spec.name
        assert len(info.cluster.replicas or []) == 2, f"{spec.name}: a leader and two followers"
    assert (await js.consumer_info(DURABLE.stream, DURABLE.durable)).cluster is not None

    portal = await connect(cluster, tls_files, authority.issue_user("portal", ROLE_PERMISSIONS["portal"]))
    pjs = portal.jetstream()
    acked: list[int] = []

    async def send(n: int) -> None:
        for _ in range(n):
            body, msg_id = json.dumps({"n": len(acked)}).encode(), f"n-{len(acked)}"

            async def published(body: bytes = body, msg_id: str = msg_id) -> Any:
                try:
                    return await pjs.publish(
                        "gpuaas.allocation.requested", body, timeout=10, headers={"Nats-Msg-Id": msg_id}
                    )
                except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
                    # Nobody stored it: the stream's interest has not reached this server over the routes yet
                    # (seen right after provisioning), or its leader is being elected. Sent again, as a portal does.
                    return None

            acked.append((await eventually(published, timeout=30, what=f"publish {msg_id} stored")).seq)

    await send(50)
    # Kill the stream's leader: the worst server to lose.
    leader = (await js.stream_info("ALLOCATIONS")).cluster.leader
    victim = next(s for s in cluster.servers if s.server_name == leader)
    victim.kill()

    async def new_leaders() -> bool:
        # The stream and its consumer elect their leaders apart: a fetch before the consumer has one is answered
        # 503 (seen in a run), so both must have moved off the dead server.
        try:
            stream = await js.stream_info("ALLOCATIONS")
            durable = await js.consumer_info(DURABLE.stream, DURABLE.durable)
        except Exception:  # no leader for a moment: the API times out until the election ends
            return False
        return all(c is not None and c.leader and c.leader != leader for c in (stream.cluster, durable.cluster))

    await eventually(new_leaders, timeout=30, what="new ALLOCATIONS stream and consumer leaders")
    await send(50)

    allocator = await connect(cluster, tls_files, authority.issue_user("allocator", ROLE_PERMISSIONS["allocator"]))
    sub = await allocator.jetstream().pull_subscribe_bind(DURABLE.durable, DURABLE.stream)
    seen: list[int] = []
    while len(seen) < 100:
        for msg in await sub.fetch(100, timeout=10):
            seen.append(json.loads(msg.data)["n"])
            await msg.ack()
    assert sorted(seen) == list(range(100)), "every acknowledged publish is delivered once"

    victim.start()
    victim.wait_healthy(30)

    async def caught_up() -> bool:
        info = await js.stream_info("ALLOCATIONS")
        replicas = {r.name: r for r in info.cluster.replicas or []}
        peer = replicas.get(victim.server_name or "")
        return peer is not None and peer.current and not peer.offline

    await eventually(caught_up, timeout=30, what="the restarted server current again")
    for nc in (admin, portal, allocator):
        await nc.close()


async def test_provisioning_started_before_the_cluster_has_a_leader_waits_for_it(
    tmp_path_factory: pytest.TempPathFactory, authority: Authority, tls_files: TlsFiles
) -> None:
    """A one-shot provisioning step (compose's bus-provision) may run while the servers still elect their
    first meta leader: the JetStream API then answers 503 or nothing, and provision must wait, not fail."""
    import asyncio
    import socket

    from gpuaas_dev.testing.servers import NatsServer, free_port

    ports = [free_port() for _ in range(3)]
    servers = [
        NatsServer(
            tmp_path_factory.mktemp(f"early{i}"),
            auth=authority,
            tls=tls_files,
            server_name=f"early-n{i + 1}",
            cluster_name="early",
            cluster_port=ports[i],
            routes=tuple(p for j, p in enumerate(ports) if j != i),
        )
        for i in range(3)
    ]
    try:
        # One server of three: no quorum, so no meta leader can exist until the others run.
        servers[0].start(wait_jetstream=False)

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", servers[0].port)) == 0

        await eventually(listening, timeout=20, what="the first server's client port")
        admin = await nats.connect(
            servers=[servers[0].url],
            user_credentials=RawCredentials(authority.issue_user("admin", ROLE_PERMISSIONS["admin"]).render()),
            **client_tls_options(tls_files.ca),
            inbox_prefix=b"_INBOX_admin",
            connect_timeout=5,
        )
        js = admin.jetstream(timeout=2)
        sent = admin.stats["out_msgs"]
        task = asyncio.create_task(provision(js, [DURABLE], replicas=3))
        await eventually(lambda: admin.stats["out_msgs"] > sent, timeout=10, what="provisioning's first request")
        assert not task.done()  # asked a server with no JetStream leader: it waits, it does not fail
        for server in servers[1:]:
            server.start(wait_jetstream=False)
        outcome = await asyncio.wait_for(task, 60)
        assert {f"stream:{spec.name}" for spec in STREAMS} <= set(outcome), outcome
        for spec in STREAMS:
            assert (await js.stream_info(spec.name)).config.num_replicas == 3, spec.name
        assert (await js.consumer_info(DURABLE.stream, DURABLE.durable)).cluster is not None
        await admin.close()
    finally:
        for server in servers:
            server.stop()
