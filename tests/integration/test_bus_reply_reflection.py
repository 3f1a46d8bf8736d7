"""W9: a reply subject must not make JetStream publish for a host where the host itself may not (issue 24,
point 7), against a real nats-server in operator mode with TLS and this project's identities.

nats-server checks a client's publish permissions on the subject only, never on the reply subject, and
JetStream answers every publish to a stream (its PubAck) and every API request on the reply subject given,
from its own internal client. In one account with the streams, a host that publishes its own report with the
reply set to another host's task subject or to a lifecycle subject therefore had JetStream publish there for
it, and the streams capturing those subjects stored the answers: writes the host's permissions refuse, without
bound (each of its reports costs it one message of its own bounded subject), into streams that refuse writes
when full.

Hosts now live in an account of their own (HOSTS) that imports, as services, only the subjects the host
template allows from the account holding the streams (GPUAAS). The server rewrites the reply of an imported
request to a private reply subject in GPUAAS and hands the answer back to the asker in HOSTS, on the reply
subject it gave: there it reaches nobody but the host's own account, which holds no streams, and an answer is
never routed into an import again. What a host may do still works: publish its reports (with their PubAcks),
pull, ack and read its own task durable, dead-letter to its own DLQ subject.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import RawCredentials

from gpuaas_common.identity import Authority, Creds
from gpuaas_common.identity.permissions import HOST_JS_API, ROLE_PERMISSIONS
from gpuaas_common.identity.tls import TlsFiles, client_tls_options
from gpuaas_common.jetstream import CONSUMERS, STREAMS, node_agent_consumer, provision
from gpuaas_dev.testing.servers import NatsServer

NODES = ("n1", "n2")
# Subjects a host may not publish on, each captured by a stream, and one no stream captures.
FOREIGN = (
    "gpuaas.node.n2.tasks.slice.vm_release",
    "gpuaas.node.n2.report.task_result",
    "gpuaas.allocation.event.active",
    "gpuaas.scheduler.placement.placed",
    "gpuaas.maas.result.release",
    "gpuaas.dlq.allocator-requested",
    "gpuaas.probe.core",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, authority: Authority, tls_files: TlsFiles) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats-reflect"), auth=authority, tls=tls_files).start()
    yield srv
    srv.stop()


async def _connect(server: NatsServer, tls_files: TlsFiles, creds: Creds, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(
        server.url,
        user_credentials=RawCredentials(creds.render()),
        **client_tls_options(tls_files.ca),
        inbox_prefix=f"_INBOX_{creds.name}".encode(),
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=5,
    )


@pytest.fixture(scope="module")
async def clients(
    server: NatsServer, tls_files: TlsFiles, authority: Authority
) -> AsyncIterator[dict[str, tuple[nats.NATS, list[str]]]]:
    out: dict[str, tuple[nats.NATS, list[str]]] = {}
    errors: list[str] = []
    admin = await _connect(server, tls_files, authority.issue_user("admin", ROLE_PERMISSIONS["admin"]), errors)
    out["admin"] = (admin, errors)
    await provision(admin.jetstream(), [*CONSUMERS, *(node_agent_consumer(n) for n in NODES)])
    for node in NODES:
        errs: list[str] = []
        out[node] = (await _connect(server, tls_files, authority.issue_host(node), errs), errs)
    yield out
    for nc, _ in out.values():
        await nc.close()


async def _stored(js: object) -> dict[str, int]:
    return {s.name: (await js.stream_info(s.name)).state.last_seq for s in STREAMS}  # type: ignore[attr-defined]


async def test_a_hosts_reply_subject_makes_jetstream_publish_nowhere_but_to_the_host(
    clients: dict[str, tuple[nats.NATS, list[str]]],
) -> None:
    admin, _ = clients["admin"]
    n1, n1_errors = clients["n1"]
    js = admin.jetstream()
    seen: list[tuple[str, bytes]] = []

    async def spy(msg: nats.aio.msg.Msg) -> None:
        seen.append((msg.subject, msg.data))

    # The admin sees every subject of the account the streams live in.
    watch = await admin.subscribe(">", cb=spy)
    await admin.flush()
    await js.publish("gpuaas.node.n1.tasks.slice.vm_provision", b"a task for n1")
    before = await _stored(js)

    for reply in FOREIGN:
        # A report it may publish (the PubAck), and its own durable's API: info, and a pull.
        await n1.publish("gpuaas.node.n1.report.drift", b"{}", reply=reply)
        await n1.publish(f"{HOST_JS_API}.CONSUMER.INFO.NODE_TASKS.node-agent-n1", b"", reply=reply)
        pull = json.dumps({"batch": 1, "expires": 200_000_000}).encode()  # 0.2 s: a 408 answers it too
        await n1.publish("$JS.API.CONSUMER.MSG.NEXT.NODE_TASKS.node-agent-n1", pull, reply=reply)
    await n1.flush()
    # Everything the server sends for these goes out before the answer to a request sent after them: a last
    # publish of the same kinds with a reply of the host's own, whose PubAck and pull answer are awaited.
    ack = await n1.jetstream().publish("gpuaas.node.n1.report.drift", b"{}", timeout=5)
    assert ack.stream == "NODE_REPORTS"
    await asyncio.wait_for(_own_pull_answered(n1), 5)
    await admin.flush()
    await watch.unsubscribe()

    reflected = [(s, d[:80]) for s, d in seen if s in FOREIGN]
    assert reflected == [], f"JetStream published for n1 onto {reflected}"
    after = await _stored(js)
    grown = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    # Only n1's own reports were stored: one per reflected publish and the last one.
    assert grown == {"NODE_REPORTS": len(FOREIGN) + 1}, grown
    assert not n1_errors, n1_errors


async def _own_pull_answered(n1: nats.NATS) -> None:
    sub = await n1.jetstream().pull_subscribe_bind(
        "node-agent-n1", stream="NODE_TASKS", inbox_prefix=b"_INBOX_node-n1."
    )
    try:
        msgs = await sub.fetch(1, timeout=3)
    except nats.errors.TimeoutError:
        return  # the reflected pull took the task: answered all the same
    await msgs[0].ack_sync()


async def test_what_a_host_may_do_still_works_across_its_account(
    clients: dict[str, tuple[nats.NATS, list[str]]],
) -> None:
    admin, _ = clients["admin"]
    n2, n2_errors = clients["n2"]
    admin_js = admin.jetstream()
    await admin_js.publish("gpuaas.node.n2.tasks.slice.vm_provision", b"task-for-n2", headers={"Nats-Msg-Id": "t-n2-1"})
    js = n2.jetstream()
    ack = await js.publish("gpuaas.node.n2.report.parity", b"{}", headers={"Nats-Msg-Id": "r-n2-1"}, timeout=5)
    assert ack.stream == "NODE_REPORTS" and not ack.duplicate
    again = await js.publish("gpuaas.node.n2.report.parity", b"{}", headers={"Nats-Msg-Id": "r-n2-1"}, timeout=5)
    assert again.duplicate, "headers cross the accounts: the duplicate window still holds"
    stored = await admin_js.get_msg("NODE_REPORTS", ack.seq)
    assert stored.subject == "gpuaas.node.n2.report.parity" and stored.headers["Nats-Msg-Id"] == "r-n2-1"
    # Its durable's info, through the prefix HOSTS imports the JetStream API under (a HostLink's context).
    info = await n2.jetstream(prefix=HOST_JS_API).consumer_info("NODE_TASKS", "node-agent-n2")
    assert info.config.filter_subject == "gpuaas.node.n2.tasks.>"
    sub = await js.pull_subscribe_bind("node-agent-n2", stream="NODE_TASKS", inbox_prefix=b"_INBOX_node-n2.")
    msgs = await sub.fetch(1, timeout=5)
    assert msgs[0].data == b"task-for-n2"
    await msgs[0].in_progress()
    await msgs[0].ack_sync()
    assert (await admin_js.consumer_info("NODE_TASKS", "node-agent-n2")).num_ack_pending == 0
    assert not n2_errors, n2_errors
