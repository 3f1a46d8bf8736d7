"""Least privilege on the bus, enforced by a real nats-server in operator mode with TLS.

For every identity: each allowed action works, and a representative set of forbidden ones (another
host's tasks and reports, `allocation.requested` from an agent, stream/consumer admin from an agent,
any write from ops) fails with the server's permissions violation. Unauthenticated, plain-text,
foreign-signed, expired and revoked clients are refused; revocation needs no restart.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import asyncpg
import nats
import pytest
from nats.aio.client import RawCredentials
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from structlog.testing import capture_logs

from gpuaas_allocator.entrypoints.main import query_responder, terminal_intake
from gpuaas_allocator.service_layer.terminal import Session, TerminalHub
from gpuaas_common.contract import ALL as ALL_SPECS
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as msgs
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.db import create_pool
from gpuaas_common.identity import Authority, Creds
from gpuaas_common.identity.permissions import (
    HOST_MAX_PAYLOAD,
    HOST_MAX_SUBS,
    ROLE_PERMISSIONS,
    SERVICES,
    durables_of,
    host_report_subjects,
    inbox_prefix,
    node_template,
    node_user_name,
    produced_subjects,
    render_table,
    requests_of,
)
from gpuaas_common.identity.tls import TlsFiles, client_context, client_tls_options, make_ca_and_server_cert
from gpuaas_common.jetstream import (
    CONSUMERS,
    FOLLOWERS,
    REPORTS_PER_SUBJECT,
    STREAM_BY_NAME,
    DurableNotAsProvisioned,
    deployed,
    ensure_consumer,
    node_agent_consumer,
    provision,
)
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.natsconn import NatsIdentity
from gpuaas_dev.testing.servers import NatsServer, _http_ok

NODES = ("n1", "n2")


class Client:
    """A connection that records the server's asynchronous errors, so a test can ask what was refused."""

    def __init__(self, nc: nats.NATS, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def _refused(self, needle: str) -> bool:
        # The server answers a forbidden PUB/SUB with -ERR before the PONG of the next flush; two
        # flushes make sure the error callback has run.
        await self.nc.flush()
        await self.nc.flush()
        return any(needle.lower() in e.lower() for e in self.errors)  # nats-py lower-cases -ERR texts

    async def can_publish(self, subject: str, data: bytes = b"{}") -> bool:
        self.errors.clear()
        await self.nc.publish(subject, data)
        return not await self._refused(f'publish to "{subject}"')

    async def can_subscribe(self, subject: str) -> bool:
        self.errors.clear()
        sub = await self.nc.subscribe(subject)
        refused = await self._refused(f'subscription to "{subject}"')
        if not refused:
            await sub.unsubscribe()
        return not refused


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, authority: Authority, tls_files: TlsFiles) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats-auth"), auth=authority, tls=tls_files).start()
    yield srv
    srv.stop()


async def connect(server: NatsServer, tls_files: TlsFiles, creds: Creds, **kw: object) -> Client:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        server.url,
        user_credentials=RawCredentials(creds.render()),
        **client_tls_options(tls_files.ca),
        inbox_prefix=f"_INBOX_{creds.name}".encode(),
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=5,
        **kw,
    )
    return Client(nc, errors)


@pytest.fixture(scope="module")
async def clients(server: NatsServer, tls_files: TlsFiles, authority: Authority) -> AsyncIterator[dict[str, Client]]:
    out: dict[str, Client] = {}
    for role, perms in ROLE_PERMISSIONS.items():
        out[role] = await connect(server, tls_files, authority.issue_user(role, perms))
    await provision(out["admin"].nc.jetstream(), [*CONSUMERS, *(node_agent_consumer(n) for n in NODES)])
    for node in NODES:
        out[node] = await connect(server, tls_files, authority.issue_host(node))
    yield out
    for c in out.values():
        await c.nc.close()


def _concrete(subject: str) -> str:
    return subject.replace("*", "nx")  # a host no test reads tasks of


# --- services -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
async def test_service_publishes_what_it_produces_and_nothing_else(clients: dict[str, Client], service: str) -> None:
    c = clients[service]
    js = c.nc.jetstream()
    asks = set(requests_of(service))  # core request/reply subjects, outside every stream
    for subject in produced_subjects(service):
        if subject in asks:
            assert await c.can_publish(subject), subject
            continue
        ack = await js.publish(_concrete(subject), b"{}", timeout=5)
        assert ack.stream, subject
    others = {s for other in ("portal", *SERVICES) if other != service for s in produced_subjects(other)}
    for subject in sorted(others - set(produced_subjects(service))):
        assert not await c.can_publish(_concrete(subject)), f"{service} may publish {subject}"


@pytest.mark.parametrize("sender", ["image-pipeline", "scheduler"])
async def test_a_service_may_send_only_its_own_node_task_types(clients: dict[str, Client], sender: str) -> None:
    """N6: the image pipeline (prewarms) and the scheduler (discovery, parity, vfio) may not send a host the
    allocator's VM release or terminal open: the server refuses the publish on that type's subject (before, every
    task type shared `gpuaas.node.<id>.tasks`, which all three might publish)."""
    for type_ in ("slice.vm_release", "slice.terminal_open", "slice.vm_provision"):
        subject = spec_for(type_).subject(node_id="nx")  # a host no test reads tasks of
        assert not await clients[sender].can_publish(subject), f"{sender} may send {type_}"
        assert await clients["allocator"].can_publish(subject), f"the allocator may not send {type_}"
    own = {s.type for s in ALL_SPECS if sender in s.producers and s.address and ".tasks." in s.address}
    assert own, f"{sender} sends no node task at all"
    for type_ in own:
        ack = await clients[sender].nc.jetstream().publish(spec_for(type_).subject(node_id="nx"), b"{}", timeout=5)
        assert ack.stream == "NODE_TASKS", type_
        assert not await clients["allocator"].can_publish(spec_for(type_).subject(node_id="nx")), type_


@pytest.mark.parametrize("service", SERVICES)
async def test_service_reads_only_its_own_durables(clients: dict[str, Client], service: str) -> None:
    c = clients[service]
    js = c.nc.jetstream()
    c.errors.clear()
    for spec in durables_of(service):
        info = await js.consumer_info(spec.stream, spec.durable)
        assert info.config.durable_name == spec.durable
        sub = await js.pull_subscribe_bind(spec.durable, stream=spec.stream, inbox_prefix=f"_INBOX_{service}.".encode())
        try:
            for msg in await sub.fetch(1, timeout=0.3):
                await msg.ack_sync()  # fetch and ack are allowed on its own durable
        except nats.errors.TimeoutError:
            pass  # allowed, and simply nothing there for it
        assert not c.errors, c.errors
    foreign = next(spec for spec in CONSUMERS if not spec.durable.startswith(f"{service}-"))
    assert not await c.can_publish(f"$JS.API.CONSUMER.MSG.NEXT.{foreign.stream}.{foreign.durable}")
    assert not await c.can_publish(f"$JS.API.CONSUMER.INFO.{foreign.stream}.{foreign.durable}")
    assert not await c.can_publish("$JS.API.STREAM.CREATE.EVIL")
    assert not await c.can_publish(f"$JS.API.STREAM.DELETE.{foreign.stream}")
    assert not await c.can_subscribe("_INBOX.>"), "a shared inbox would let it read others' replies"


@pytest.mark.parametrize("service", SERVICES)
async def test_no_service_may_create_or_change_a_durable(clients: dict[str, Client], service: str) -> None:
    """The admin identity makes every durable (issue 24): a service that could create its own, even with its filter
    pinned in the create subject, would choose its every other field (ack wait, deliveries, deliver policy)."""
    c = clients[service]
    for spec in durables_of(service):
        s, d = spec.stream, spec.durable
        for subject in (f"$JS.API.CONSUMER.CREATE.{s}.{d}.{spec.filter_subject}", f"$JS.API.CONSUMER.CREATE.{s}.{d}"):
            assert not await c.can_publish(subject), f"{service} may publish {subject}"
        assert not await c.can_publish(f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.{d}")
        assert not await c.can_publish(f"$JS.API.CONSUMER.DELETE.{s}.{d}")
        assert await ensure_consumer(c.nc.jetstream(), deployed(spec), create=False) == "bound"


async def test_a_durable_with_several_filters_is_bound_never_created_by_its_service(
    clients: dict[str, Client],
) -> None:
    """The scheduler's lifecycle durable filters on the events it acts on; the admin provisioned it, the
    scheduler binds to it and receives only those, and may neither create nor widen it."""
    spec = next(c for c in durables_of("scheduler") if c.admin_provisioned)
    c = clients["scheduler"]
    js = c.nc.jetstream()
    assert await ensure_consumer(js, spec, create=False) == "bound"
    info = await js.consumer_info(spec.stream, spec.durable)
    assert sorted(info.config.filter_subjects or []) == sorted(spec.filters)
    assert "gpuaas.allocation.event.placed" not in spec.filters
    # Creating or updating it (any filter, the create subject names none) is refused; so is the subject form
    # that names a single filter, for a wider one.
    assert not await c.can_publish(f"$JS.API.CONSUMER.CREATE.{spec.stream}.{spec.durable}")
    assert not await c.can_publish(f"$JS.API.CONSUMER.CREATE.{spec.stream}.{spec.durable}.gpuaas.allocation.>")
    # Declared otherwise than provisioned (an older provisioning, say): the service refuses to bind.
    narrower = replace(spec, filter_subjects=spec.filter_subjects[:-1])
    with pytest.raises(DurableNotAsProvisioned, match="run the admin's provisioning"):
        await ensure_consumer(js, narrower, create=False)


# --- node agents ----------------------------------------------------------------------------------------


async def test_node_agent_fetches_and_acks_only_its_own_tasks(clients: dict[str, Client]) -> None:
    admin_js = clients["admin"].nc.jetstream()
    await admin_js.publish("gpuaas.node.n1.tasks.slice.vm_provision", b"task-for-n1")
    await admin_js.publish("gpuaas.node.n2.tasks.slice.vm_provision", b"task-for-n2")
    n1 = clients["n1"]
    js = n1.nc.jetstream()
    sub = await js.pull_subscribe_bind("node-agent-n1", stream="NODE_TASKS", inbox_prefix=b"_INBOX_node-n1.")
    msgs = await sub.fetch(1, timeout=5)
    assert msgs[0].data == b"task-for-n1"
    await msgs[0].ack_sync()
    # Another host's durable, directly or through its own durable's API, is closed.
    assert not await n1.can_publish("$JS.API.CONSUMER.MSG.NEXT.NODE_TASKS.node-agent-n2")
    assert not await n1.can_publish("$JS.API.CONSUMER.INFO.NODE_TASKS.node-agent-n2")
    assert not await n1.can_publish("$JS.ACK.NODE_TASKS.node-agent-n2.1.1.1.1.0")
    # n2's task is still there for n2.
    n2_sub = (
        await clients["n2"]
        .nc.jetstream()
        .pull_subscribe_bind("node-agent-n2", stream="NODE_TASKS", inbox_prefix=b"_INBOX_node-n2.")
    )
    assert (await n2_sub.fetch(1, timeout=5))[0].data == b"task-for-n2"


async def test_node_agent_reports_only_as_itself(clients: dict[str, Client]) -> None:
    n1 = clients["n1"]
    ack = await n1.nc.jetstream().publish("gpuaas.node.n1.report.parity", b"{}", timeout=5)
    assert ack.stream == "NODE_REPORTS"
    for forbidden in (
        # Out of the DLQ path (issue 38): a host's dead letters were rows in ops' database at the host's rate.
        "gpuaas.dlq.node-agent-n1",
        "gpuaas.node.n2.report.parity",
        "gpuaas.node.n2.report.task_result",
        "gpuaas.allocation.requested",
        "gpuaas.allocation.event.active",
        "gpuaas.node.n1.tasks.slice.vm_provision",
        "gpuaas.node.n2.tasks.slice.vm_release",
        "gpuaas.maas.command.deploy",
        "gpuaas.dlq.allocator-requested",
    ):
        assert not await n1.can_publish(forbidden), forbidden


async def test_node_agent_cannot_administer_streams_or_read_others(clients: dict[str, Client]) -> None:
    n1 = clients["n1"]
    for forbidden in (
        "$JS.API.STREAM.CREATE.X",
        "$JS.API.STREAM.UPDATE.NODE_TASKS",
        "$JS.API.STREAM.DELETE.NODE_TASKS",
        "$JS.API.CONSUMER.CREATE.NODE_TASKS.spy.gpuaas.node.n2.tasks.>",
        "$JS.API.CONSUMER.DURABLE.CREATE.NODE_TASKS.spy",
        "$JS.API.CONSUMER.CREATE.NODE_TASKS",
        "$JS.API.CONSUMER.DELETE.NODE_TASKS.node-agent-n1",
        "$JS.API.STREAM.MSG.GET.NODE_TASKS",
        "$JS.API.DIRECT.GET.NODE_TASKS",
    ):
        assert not await n1.can_publish(forbidden), forbidden
    for forbidden in ("gpuaas.node.n2.tasks.>", "gpuaas.>", "_INBOX.>", "_INBOX_node-n2.>", ">"):
        assert not await n1.can_subscribe(forbidden), forbidden
    assert await n1.can_subscribe("_INBOX_node-n1.x")


async def test_a_host_relays_a_terminal_only_on_its_own_subjects_and_the_allocator_answers_on_its_inbox(
    clients: dict[str, Client],
) -> None:
    """The slice terminal's two requests under the real identities: the host asks on its own subjects, the
    allocator's real responder answers on the host's inbox; no host may ask on another's subjects or listen to
    any terminal subject (it would read or answer another host's session)."""
    allocator, n1 = clients["allocator"], clients["n1"]
    hub = TerminalHub(lambda: None, session_max_s=60, input_hold_s=5)  # type: ignore[arg-type,return-value]
    session = Session(uuid.uuid4(), uuid.uuid4(), "n1")
    hub.sessions[session.session_id] = session
    subs = []
    for type_, answer in (("node.terminal_output", hub.on_output), ("node.terminal_input", hub.on_input)):
        every_host = str(spec_for(type_).address).replace("{node_id}", "*")
        allocator.errors.clear()
        subs.append(await allocator.nc.subscribe(every_host, cb=terminal_intake(hub, type_, answer)))
        assert not await allocator._refused(f'subscription to "{every_host}"')
    validator = default_validator()
    # The tenant's websocket, reading: the output's ack waits until its bytes were taken (review 3, N7).
    got: list[bytes] = []

    async def websocket() -> None:
        while (chunk := await session.output.get()) is not None:
            got.append(chunk)
            session.written(len(chunk))

    reading = asyncio.create_task(websocket())
    try:
        hub.type(session, b"uname -a\n")
        answers = {}
        for type_, payload in (
            ("node.terminal_input", msgs.NodeTerminalInput(session_id=session.session_id, node_id="n1", received=0)),
            (
                "node.terminal_output",
                msgs.NodeTerminalOutput(session_id=session.session_id, node_id="n1", offset=0, data="TGludXgK"),
            ),
        ):
            env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="node-agent", correlation_id="n1")
            n1.errors.clear()
            subject = spec_for(type_).subject(node_id="n1")
            reply = await n1.nc.request(subject, env.model_dump_json().encode(), timeout=10)
            assert reply.subject.startswith(f"{inbox_prefix('node-n1')}."), reply.subject
            answers[type_] = validator.validate(reply.subject, reply.data)
            assert answers[type_]["type"] == spec_for(type_).reply
            assert answers[type_]["payload"]["status"] == "open"
            assert n1.errors == []
        assert base64.b64decode(answers["node.terminal_input"]["payload"]["data"]) == b"uname -a\n"
        assert answers["node.terminal_output"]["payload"]["received"] == len(b"Linux\n")
        assert got == [b"Linux\n"]
    finally:
        session.output.put_nowait(None)
        await reading
        for sub in subs:
            await sub.unsubscribe()

    for forbidden in ("gpuaas.node.n2.terminal.output", "gpuaas.node.n2.terminal.input", "gpuaas.node.n1.terminal.x"):
        assert not await n1.can_publish(forbidden), forbidden
    for role in ("n1", "n2", "portal", "ops", "scheduler"):
        for forbidden in (
            "gpuaas.node.n1.terminal.output",
            "gpuaas.node.n1.terminal.input",
            "gpuaas.node.*.terminal.*",
        ):
            assert not await clients[role].can_subscribe(forbidden), (role, forbidden)
    assert all(">" not in s for s in node_template().pub_allow if ".terminal." in s)


async def test_a_baremetal_tenants_host_may_enrol_and_do_nothing_a_slice_host_does(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, clients: dict[str, Client]
) -> None:
    """Issue 38 (N3, N11): the allocation-bound user a tenant's deploy carries (the tenant has root and its creds
    file) is signed by the baremetal hosts' key, whose template is its enrolment report only. Before, it had a
    slice host's template: its task queue, the terminal subjects every allocator replica answers, every slice
    report and its dead letters."""
    node = "bm1"
    admin_js = clients["admin"].nc.jetstream()
    # A task durable for the node, as a slice host's (tasks queued before its mode change could sit there).
    await ensure_consumer(admin_js, node_agent_consumer(node))
    await admin_js.publish(f"gpuaas.node.{node}.tasks.slice.vfio_apply", b"a task left from slice mode")
    creds = authority.issuer().issue_node(node, ttl_s=600, allocation_id=str(uuid.uuid4()))
    bm = await connect(server, tls_files, creds)
    try:
        validator = default_validator()
        env = Envelope.wrap(
            "node.enrolled",
            msgs.NodeEnrolled(
                node_id=node,
                kind="baremetal",
                hostname="bm1",
                agent_version="test",
                maas_system_id="abc123",
                allocation_id=uuid.uuid4(),
                enrolment_proof="0" * 64,
            ).model_dump(mode="json"),
            producer="node-agent",
            correlation_id=node,
        )
        subject = spec_for("node.enrolled").subject(node_id=node)
        body = env.model_dump_json().encode()
        validator.validate(subject, body)
        ack = await bm.nc.jetstream().publish(subject, body, timeout=5)
        assert ack.stream == "NODE_REPORTS"  # its enrolment reaches the allocator's stream, as before
        for forbidden in (
            f"gpuaas.node.{node}.terminal.input",
            f"gpuaas.node.{node}.terminal.output",
            *(s for s in host_report_subjects(node) if not s.endswith(".report.enrolled")),
            f"$JS.API.CONSUMER.MSG.NEXT.NODE_TASKS.node-agent-{node}",
            f"$JS.ACK.NODE_TASKS.node-agent-{node}.1.1.1.1.0",
            f"$JS.GPUAAS.API.CONSUMER.INFO.NODE_TASKS.node-agent-{node}",
            f"gpuaas.dlq.node-agent-{node}",
        ):
            assert not await bm.can_publish(forbidden), forbidden
        # Its task queue keeps the task: nothing was pulled.
        assert (await admin_js.consumer_info("NODE_TASKS", f"node-agent-{node}")).num_pending == 1
    finally:
        await bm.nc.close()


# --- portal, ops ----------------------------------------------------------------------------------------


async def test_portal_requests_and_follows_the_lifecycle_only(clients: dict[str, Client]) -> None:
    portal = clients["portal"]
    js = portal.nc.jetstream()
    for subject in ("gpuaas.allocation.requested", "gpuaas.allocation.release_requested"):
        assert (await js.publish(subject, b"{}", timeout=5)).stream == "ALLOCATIONS"
    assert await portal.can_subscribe("gpuaas.allocation.event.>")
    for forbidden in (
        "gpuaas.allocation.event.active",
        "gpuaas.node.n1.tasks.slice.vm_provision",
        "gpuaas.node.n1.report.task_result",
        "gpuaas.maas.command.deploy",
        "$JS.API.STREAM.CREATE.X",
        "$JS.API.CONSUMER.MSG.NEXT.ALLOCATIONS.allocator-requested",
    ):
        assert not await portal.can_publish(forbidden), forbidden
    for forbidden in ("gpuaas.node.n1.tasks.>", "gpuaas.allocation.requested", "gpuaas.maas.>"):
        assert not await portal.can_subscribe(forbidden), forbidden


async def test_ops_reads_lifecycle_and_reports_and_writes_nothing(clients: dict[str, Client]) -> None:
    ops = clients["ops"]
    for subject in ("gpuaas.allocation.event.>", "gpuaas.node.*.report.>", "gpuaas.dlq.>"):
        assert await ops.can_subscribe(subject), subject
    for forbidden in (
        "gpuaas.allocation.requested",
        "gpuaas.allocation.release_requested",
        "gpuaas.node.n1.tasks.slice.topology_discover",
        "gpuaas.maas.command.release",
        "$JS.API.STREAM.INFO.ALLOCATIONS",
        "$JS.API.STREAM.CREATE.X",
    ):
        assert not await ops.can_publish(forbidden), forbidden
    assert not await ops.can_subscribe("gpuaas.node.n1.tasks.>"), "tasks carry tenants' keys and plans"


# --- request/reply: allocation.query -------------------------------------------------------------------


async def test_portal_ops_and_scheduler_ask_allocation_queries_and_only_the_allocator_answers(
    clients: dict[str, Client], fresh_db: str
) -> None:
    """The allocator's real responder under the allocator's identity: portal, ops and scheduler get its answer on their
    own inbox; it may answer each request once and write to no other inbox; no one else may ask or answer."""
    subject = spec_for("allocation.query").subject()
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator", min_size=1, max_size=1)
    allocator = clients["allocator"]
    answering = await allocator.nc.subscribe(subject, queue="allocator", cb=query_responder(pool))
    try:
        assert not await allocator._refused(f'subscription to "{subject}"')
        validator = default_validator()
        for role in ("portal", "ops", "scheduler"):  # the scheduler asks for its claim audit
            asker = clients[role]
            query = Envelope.wrap("allocation.query", {"state": "active"}, producer=role, correlation_id=f"q-{role}")
            asker.errors.clear()
            reply = await asker.nc.request(subject, query.model_dump_json().encode(), timeout=10)
            assert reply.subject.startswith(f"{inbox_prefix(role)}."), reply.subject
            data = validator.validate(reply.subject, reply.data)
            assert (data["type"], data["correlation_id"], data["payload"]["status"]) == (
                "allocation.query_result",
                f"q-{role}",
                "found",
            )
            assert asker.errors == []

        # One answer per request received: a second one to the same inbox is refused, and so is any other inbox.
        await answering.unsubscribe()
        requests = await allocator.nc.subscribe(subject, queue="allocator")
        await allocator.nc.flush()
        ops = clients["ops"]
        await ops.nc.publish(subject, b"{}", reply=f"{inbox_prefix('ops')}.once")
        received = await requests.next_msg(timeout=5)
        await requests.unsubscribe()
        assert received.reply == f"{inbox_prefix('ops')}.once"
        assert await allocator.can_publish(received.reply)
        assert not await allocator.can_publish(received.reply)
        assert not await allocator.can_publish(f"{inbox_prefix('ops')}.never-asked")
        assert not await allocator.can_publish(f"{inbox_prefix('portal')}.never-asked")
        assert not await allocator.can_publish(subject), "the allocator answers queries, it does not ask"
    finally:
        with contextlib.suppress(nats.errors.BadSubscriptionError):
            await answering.unsubscribe()  # already gone unless an assertion above failed
        await pool.close()

    for role in ("image-pipeline", "maas-gateway", "n1"):
        assert not await clients[role].can_publish(subject), f"{role} may ask allocation queries"
    for role in ("portal", "ops", "scheduler", "n1"):
        # Subscribing would let it read others' queries and answer in the allocator's place.
        assert not await clients[role].can_subscribe(subject), f"{role} may take allocation queries"


async def test_the_allocator_answers_queries_only_on_an_askers_inbox(clients: dict[str, Client], fresh_db: str) -> None:
    """N9: an `ops` user that names a stream subject (`gpuaas.image.event.activated`) as its query's reply would
    have had the allocator, under its `resp` right, write its answer into IMAGES; it is refused and counted, and
    nothing is stored. The next query, on the asker's own inbox, is answered (the responder takes one query at a
    time, in order, so the refused one was handled before this answer was sent)."""
    subject = spec_for("allocation.query").subject()
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "allocator", "gpuaas_allocator.migrations")
    await conn.close()
    pool = await create_pool(fresh_db, "allocator", min_size=1, max_size=1)
    allocator, ops, admin = clients["allocator"], clients["ops"], clients["admin"]
    admin_js = admin.nc.jetstream()
    answering = await allocator.nc.subscribe(subject, queue="allocator", cb=query_responder(pool))
    refused_before = _sample("gpuaas_allocator_queries_refused_total")
    images_before = (await admin_js.stream_info("IMAGES")).state.last_seq
    try:
        await allocator.nc.flush()
        query = Envelope.wrap("allocation.query", {"state": "active"}, producer="ops", correlation_id="q-reflect")
        body = query.model_dump_json().encode()
        forged = ("gpuaas.image.event.activated", "gpuaas.scheduler.placement.placed", f"{inbox_prefix('ops')}x.1")
        with capture_logs() as logs:
            for reply in forged:
                await ops.nc.publish(subject, body, reply=reply)
            answer = await ops.nc.request(subject, body, timeout=10)
        assert answer.subject.startswith(f"{inbox_prefix('ops')}.")
        assert default_validator().validate(answer.subject, answer.data)["payload"]["status"] == "found"
        # A message stored after the refused ones: had any reached IMAGES, it would come before this one.
        marker = await admin_js.publish("gpuaas.image.event.published", b"marker", timeout=5)
        assert marker.seq == images_before + 1, "the allocator's answer was stored in IMAGES"
        assert _sample("gpuaas_allocator_queries_refused_total") - refused_before == len(forged)
        assert [e["reply"] for e in logs if e["event"] == "allocation_query_refused"] == list(forged)
    finally:
        await answering.unsubscribe()
        await pool.close()


def _sample(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name) or 0.0


# --- refused connections --------------------------------------------------------------------------------


async def test_unauthenticated_client_is_refused(server: NatsServer, tls_files: TlsFiles) -> None:
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await nats.connect(server.url, **client_tls_options(tls_files.ca), allow_reconnect=False, connect_timeout=5)


def test_plain_text_client_is_refused(server: NatsServer) -> None:
    """The server speaks TLS first (handshake_first): a client that starts in plaintext gets no INFO, so no
    nonce to sign, and its CONNECT ends the connection instead of being answered."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        assert b"INFO" not in answer and b"PONG" not in answer, answer


async def test_a_client_that_waits_for_the_servers_info_is_not_served(server: NatsServer, tls_files: TlsFiles) -> None:
    """nats-py without tls_handshake_first waits for INFO, which a handshake_first server never sends in clear:
    the server gives up on the handshake (its TLS timeout, 2 s, inside our 5) and closes without a word."""
    with pytest.raises(nats.errors.Error, match="empty response from server when expecting INFO"):
        await nats.connect(server.url, tls=client_context(tls_files.ca), allow_reconnect=False, connect_timeout=5)


def test_monitoring_listener_speaks_only_tls(server: NatsServer, tls_files: TlsFiles) -> None:
    health = f"127.0.0.1:{server.monitor_port}/healthz"
    assert _http_ok(f"https://{health}", str(tls_files.ca))
    assert not _http_ok(f"http://{health}"), "a plain-HTTP listener answered"


async def test_client_trusting_another_ca_is_refused(server: NatsServer, authority: Authority, tmp_path: Path) -> None:
    other = make_ca_and_server_cert(tmp_path / "other")
    creds = authority.issue_user("portal", ROLE_PERMISSIONS["portal"])
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(
            server.url,
            user_credentials=RawCredentials(creds.render()),
            **client_tls_options(other.ca),
            allow_reconnect=False,
            connect_timeout=5,
        )


@pytest.mark.parametrize("case", ["foreign_signed", "expired", "malformed"])
async def test_bad_credentials_are_refused_with_the_servers_reason(
    server: NatsServer,
    tls_files: TlsFiles,
    authority: Authority,
    tmp_path: Path,
    case: str,
) -> None:
    if case == "foreign_signed":
        creds = Authority.create().issue_user("portal", ROLE_PERMISSIONS["portal"])
        text = creds.render()
    elif case == "expired":
        creds = authority.issue_user("portal", ROLE_PERMISSIONS["portal"], ttl_s=-60)
        text = creds.render()
    else:
        good = authority.issue_user("portal", ROLE_PERMISSIONS["portal"])
        text = good.render().replace(good.jwt, good.jwt[:-20] + "A" * 20)  # signature no longer verifies
        creds = good
    path = tmp_path / "bad.creds"
    path.write_text(text)
    identity = NatsIdentity([server.url], str(path), str(tls_files.ca))
    with capture_logs() as logs:
        for _ in range(2):  # a second refusal of the same kind is not logged again
            with pytest.raises(Exception, match="(?i)authorization violation"):
                # Generous: for a foreign account the server first asks its resolver, then refuses.
                await identity.connect(name="bad", retry_forever=False, allow_reconnect=False, connect_timeout=10)
    warnings = [e for e in logs if e["event"] == "nats_auth_refused"]
    assert len(warnings) == 1, logs
    assert "authorization violation" in warnings[0]["reason"].lower()
    assert creds.seed.decode() not in repr(logs) and creds.jwt not in repr(logs)


async def test_a_revoked_host_is_disconnected_at_once_and_cannot_come_back(
    clients: dict[str, Client],
    server: NatsServer,
    tls_files: TlsFiles,
    authority: Authority,
) -> None:
    creds = authority.issue_host("n3")
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    host = await connect(server, tls_files, creds, closed_cb=on_closed)
    assert await host.can_publish("gpuaas.node.n3.report.parity")
    await authority.issuer().revoke(
        [server.url], authority.issued_hosts["n3"], js=clients["admin"].nc.jetstream(), tls=client_context(tls_files.ca)
    )
    await asyncio.wait_for(closed.wait(), timeout=5)  # no server restart: the account update closed it
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await connect(server, tls_files, creds)
    # The revocation touched nobody else.
    other = await connect(server, tls_files, authority.issue_host("n4"))
    assert await other.can_publish("gpuaas.node.n4.report.parity")
    await other.nc.close()


async def test_concurrent_revocations_are_all_kept(
    clients: dict[str, Client], server: NatsServer, tls_files: TlsFiles, authority: Authority
) -> None:
    """Gateway replicas and an ops command may revoke at the same moment: none of them may be lost."""
    issued = [authority.issue_host(f"c{i}") for i in range(8)]
    ctx = client_context(tls_files.ca)
    js = clients["admin"].nc.jetstream()
    await asyncio.gather(
        *(authority.issuer().revoke([server.url], [str(c.claims["sub"])], js=js, tls=ctx) for c in issued)
    )
    for creds in issued:
        with pytest.raises(Exception, match="(?i)authorization violation"):
            await connect(server, tls_files, creds)


def test_readme_identity_table_matches_the_code(repo_root: Path) -> None:
    readme = (repo_root / "README.md").read_text()
    assert render_table() in readme, "README's identity table drifted: paste `gpuaas identities table`"


def test_every_node_user_is_named_for_its_host(authority: Authority) -> None:
    creds = authority.issue_host("slice-07")
    assert creds.name == node_user_name("slice-07")
    assert "node:slice-07" in creds.claims["nats"]["tags"]
    assert "pub" not in creds.claims["nats"], "a scoped key's user must carry no permissions of its own"


# --- floods (W4) ----------------------------------------------------------------------------------------


async def test_a_host_over_its_limits_is_refused_by_the_server(
    clients: dict[str, Client], server: NatsServer, tls_files: TlsFiles, authority: Authority
) -> None:
    """A report suffix no node agent produces, a report over the host payload limit and one subscription past
    the host limit: each refused by the server itself, whatever the host's client does. The last two are
    protocol errors, on which nats-py (like the server, for the payload) ends the connection."""
    creds = authority.issue_host("greedy")
    host = await connect(server, tls_files, creds)
    assert not await host.can_publish("gpuaas.node.greedy.report.bogus_suffix")
    assert await host.can_publish("gpuaas.node.greedy.report.parity")
    await host.nc.close()

    async def closed_after(excess: Callable[[nats.NATS], Awaitable[object]]) -> nats.NATS:
        closed = asyncio.Event()

        async def on_closed() -> None:
            closed.set()

        c = await connect(server, tls_files, creds, closed_cb=on_closed)
        await excess(c.nc)
        await asyncio.wait_for(closed.wait(), timeout=5)
        return c.nc

    async def subscribe_past_the_limit(nc: nats.NATS) -> None:
        for i in range(HOST_MAX_SUBS + 1):
            await nc.subscribe(f"{inbox_prefix(creds.name)}.s{i}")

    nc = await closed_after(subscribe_past_the_limit)
    assert "maximum subscriptions exceeded" in str(nc.last_error).lower(), nc.last_error

    subject = "gpuaas.node.greedy.report.topology"

    async def publish_past_the_limit(nc: nats.NATS) -> None:
        assert nc.max_payload > HOST_MAX_PAYLOAD, "the client must send it for the server to judge it"
        await nc.publish(subject, b"x" * (HOST_MAX_PAYLOAD + 1))

    # The server closes the connection right after its -ERR, which the client may not read: its log says why.
    await closed_after(publish_past_the_limit)
    assert server.log_path is not None
    assert f"maximum payload exceeded: {HOST_MAX_PAYLOAD + 1} vs {HOST_MAX_PAYLOAD}" in server.log_path.read_text()
    state = await clients["admin"].nc.jetstream().stream_info("NODE_REPORTS", subjects_filter=subject)
    assert not (state.state.subjects or {}), "the oversized report was stored"


async def test_a_flooding_host_fills_only_its_own_share_while_tasks_and_lifecycle_flow(
    clients: dict[str, Client], server: NatsServer, tls_files: TlsFiles, authority: Authority
) -> None:
    """One host publishes far more reports than an agent ever would, on every subject it may use; the stream
    keeps only the newest REPORTS_PER_SUBJECT of each, and while the flood goes on another host's task and an
    allocation event are stored (PubAck) and fetched."""
    admin_js = clients["admin"].nc.jetstream()
    await ensure_consumer(admin_js, node_agent_consumer("quiet"))
    flooder = await connect(server, tls_files, authority.issue_host("flood"))
    quiet = await connect(server, tls_files, authority.issue_host("quiet"))
    reports = host_report_subjects("flood")
    rounds = REPORTS_PER_SUBJECT + 64
    before = (await admin_js.stream_info("NODE_REPORTS")).state.bytes
    past_the_bound = asyncio.Event()

    async def flood() -> None:
        js = flooder.nc.jetstream()
        for r in range(rounds):
            body = f'{{"round": {r}}}'.encode().ljust(1024)
            await asyncio.gather(*(js.publish(s, body, timeout=5) for s in reports))
            if r == REPORTS_PER_SUBJECT:
                past_the_bound.set()

    async def others_flow() -> None:
        await past_the_bound.wait()
        marker = uuid.uuid4().hex.encode()
        allocator = clients["allocator"].nc.jetstream()
        task = await allocator.publish("gpuaas.node.quiet.tasks.slice.vm_provision", b"task-" + marker, timeout=5)
        event = await allocator.publish("gpuaas.allocation.event.active", b"event-" + marker, timeout=5)
        assert (task.stream, event.stream) == ("NODE_TASKS", "ALLOCATIONS")
        sub = await quiet.nc.jetstream().pull_subscribe_bind(
            "node-agent-quiet", stream="NODE_TASKS", inbox_prefix=b"_INBOX_node-quiet."
        )
        msg = (await sub.fetch(1, timeout=5))[0]
        assert msg.data == b"task-" + marker
        await msg.ack_sync()
        # The scheduler's lifecycle durable may still hold other tests' events: read until this one.
        spec = next(c for c in durables_of("scheduler") if c.admin_provisioned)
        lifecycle = (
            await clients["scheduler"]
            .nc.jetstream()
            .pull_subscribe_bind(spec.durable, stream=spec.stream, inbox_prefix=b"_INBOX_scheduler.")
        )
        seen: list[bytes] = []
        while b"event-" + marker not in seen and len(seen) < 1000:
            for m in await lifecycle.fetch(100, timeout=5):
                seen.append(m.data)
                await m.ack()
        assert b"event-" + marker in seen

    await asyncio.wait_for(asyncio.gather(flood(), others_flow()), timeout=60)

    info = await admin_js.stream_info("NODE_REPORTS", subjects_filter="gpuaas.node.flood.report.>")
    assert info.state.subjects == {s: REPORTS_PER_SUBJECT for s in reports}
    assert info.config.max_bytes == STREAM_BY_NAME["NODE_REPORTS"].max_bytes > 0
    newest = await admin_js.get_last_msg("NODE_REPORTS", reports[0])
    assert newest.data.startswith(f'{{"round": {rounds - 1}}}'.encode())
    share = len(reports) * REPORTS_PER_SUBJECT * HOST_MAX_PAYLOAD
    assert info.state.bytes - before <= share
    await flooder.nc.close()
    await quiet.nc.close()


# --- ops read models ------------------------------------------------------------------------------------


async def test_ops_view_follows_each_stream_with_its_own_named_consumer_only(clients: dict[str, Client]) -> None:
    """The read models make their consumer afresh from their own position: create it (its name, its filter),
    pull from it and delete it; nothing of anyone else's, no other name, no wider filter, no stream admin."""
    c = clients["ops-view"]
    js = c.nc.jetstream()
    c.errors.clear()
    spec = next(f for f in FOLLOWERS if f.stream == "ALLOCATIONS")
    config = ConsumerConfig(
        name=spec.durable,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        filter_subject=spec.filter_subject,
        inactive_threshold=10.0,
    )
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_consumer(spec.stream, spec.durable)
    await js.add_consumer(spec.stream, config)
    info = await js.consumer_info(spec.stream, spec.durable)
    assert info.config.filter_subject == spec.filter_subject
    sub = await js.pull_subscribe_bind(spec.durable, stream=spec.stream, inbox_prefix=b"_INBOX_ops-view.")
    with contextlib.suppress(nats.errors.TimeoutError):
        await sub.fetch(1, timeout=0.3)
    await js.stream_info(spec.stream)
    assert await js.delete_consumer(spec.stream, spec.durable)
    assert not c.errors, c.errors
    s, d = spec.stream, spec.durable
    assert not await c.can_publish(f"$JS.API.CONSUMER.CREATE.{s}.{d}.gpuaas.allocation.>")  # portal input too
    assert not await c.can_publish(f"$JS.API.CONSUMER.CREATE.{s}.{d}")  # any filter
    assert not await c.can_publish(f"$JS.API.CONSUMER.CREATE.{s}.other.{spec.filter_subject}")
    assert not await c.can_publish(f"$JS.API.CONSUMER.MSG.NEXT.{s}.allocator-requested")
    assert not await c.can_publish(f"$JS.API.CONSUMER.DELETE.{s}.allocator-requested")
    assert not await c.can_publish(f"$JS.API.STREAM.DELETE.{s}")
    assert not await c.can_publish("gpuaas.allocation.event.active")
    assert await c.can_publish(f"gpuaas.dlq.{d}")
