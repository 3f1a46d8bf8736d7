"""Who may do what on the bus: one identity per role, least privilege by subject.

Derived, not hand-listed: a service may publish exactly the subjects the contract catalog names it the
producer of, and may create, read and fetch from exactly the durable consumers `jetstream.CONSUMERS`
declares for it. So adding a message type or a consumer updates the server-enforced rights, and the
README's table is rendered from this module (a test fails on drift).

JetStream API subjects used (checked against nats-server 2.15, see shared reference notes):
- fetch: pub `$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>`, replies on the identity's own inbox prefix;
- ack/nak/term/progress: pub `$JS.ACK.<stream>.<durable>.>`;
- bind: pub `$JS.API.CONSUMER.INFO.<stream>.<durable>`;
- create/update a durable: pub `$JS.API.CONSUMER.CREATE.<stream>.<durable>.<filter>` — the filter is part
  of the subject, so a service cannot point its durable at another stream subject; a durable with several
  filters has no such subject, so the admin identity creates it and its service may only bind to it;
- publish to a stream: pub on the subject, sub on the inbox prefix for the PubAck.
Delivery of stream messages ignores subscribe permissions; isolation comes from MSG.NEXT being allowed
on one's own durable only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..contract.catalog import ALL as MESSAGE_SPECS
from ..jetstream import CONSUMERS, FOLLOWERS, IDENTITY_BUCKET, ConsumerSpec, node_agent_consumer

SERVICES: tuple[str, ...] = ("allocator", "scheduler", "image-pipeline", "maas-gateway", "ops-view")
# Roles that are people or upstream systems rather than our services.
PORTAL, OPS, ADMIN, NODE = "portal", "ops", "admin", "node-agent"
# Tag that carries a host's node id in its user JWT; the scoped signing key's template reads it.
NODE_TAG = "node"


def inbox_prefix(name: str) -> str:
    """Each identity gets replies on a prefix of its own, so no one can read another's replies."""
    return f"_INBOX_{name}"


# How long a request's reply subject stays open to its responder (nats-server's `resp` ttl).
REPLY_WINDOW_NS = 30 * 1_000_000_000

KIB = 1024
UNLIMITED = -1
# Per-connection limits nats-server 2.15 enforces from a user JWT (or a scoped key's template): `payload`
# (a bigger PUB gets "Maximum Payload Violation" and the connection is closed) and `subs`. It reads no `data`
# limit for users (server/client.go applyAccountLimits reads Payload and Subs only), so none is written: the
# bytes a host can leave behind are bounded by the streams instead (jetstream.StreamSpec).
#
# The largest report a host sends legitimately is its topology: 10.0 KiB as an envelope for the fixture
# XE9680L (8 GPUs, 12 fabric functions, 9 NVMe disks, 7 candidate slots); parity is 2.8 KiB, task results and
# drift lists of a broken host a few KiB. 64 KiB leaves 6x for bigger hosts, headers included (the server
# counts them).
HOST_MAX_PAYLOAD = 64 * KIB
# An agent's connection for one host holds a few subscriptions (its task pull, its reply inbox).
HOST_MAX_SUBS = 64
# The portal's largest message is an allocation request with its 16 SSH keys (a 16384-bit RSA key is 2.8 KB).
PORTAL_MAX_PAYLOAD = 128 * KIB
# Ops only ask read-only queries of a few hundred bytes.
OPS_MAX_PAYLOAD = 16 * KIB
# A service opens one subscription per durable, one per request subject it answers and one reply inbox (about
# ten); portal and ops a handful. Two orders of magnitude above that, and still a bound on server memory.
CLIENT_MAX_SUBS = 1024
# Services keep the server's own limit (1 MiB): they relay tasks and MAAS commands whose size their own
# producers, not a tenant, decide.


@dataclass(frozen=True)
class Permissions:
    pub_allow: tuple[str, ...] = ()
    pub_deny: tuple[str, ...] = ()
    sub_allow: tuple[str, ...] = ()
    sub_deny: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)
    # Answers to requests received: the server lets the identity publish once to each reply subject it was
    # sent, within REPLY_WINDOW_NS, and to no other inbox.
    replies: bool = False
    max_payload: int = UNLIMITED
    max_subs: int = UNLIMITED

    def claims(self) -> dict[str, Any]:
        """The `nats.pub` / `nats.sub` (and `nats.resp`) members of a user JWT or a scoped key's template.

        An empty allow list means *unrestricted* to nats-server, so a role that may publish nothing
        gets an explicit deny of everything instead."""
        out: dict[str, Any] = {}
        for kind, allow, deny in (("pub", self.pub_allow, self.pub_deny), ("sub", self.sub_allow, self.sub_deny)):
            entry: dict[str, list[str]] = {}
            if allow:
                entry["allow"] = list(allow)
            if deny or not allow:
                entry["deny"] = list(deny) or [">"]
            out[kind] = entry
        if self.replies:
            out["resp"] = {"max": 1, "ttl": REPLY_WINDOW_NS}
        out.update({"subs": self.max_subs, "data": UNLIMITED, "payload": self.max_payload})
        return out


def _wild(address: str) -> str:
    """A contract address with its `{param}` tokens as wildcards."""
    return ".".join("*" if t.startswith("{") else t for t in address.split("."))


def produced_subjects(role: str) -> tuple[str, ...]:
    """Subjects `role` publishes on; replies go to the asker's inbox and are covered by `replies`."""
    return tuple(sorted({_wild(s.address) for s in MESSAGE_SPECS if role in s.producers and s.address is not None}))


def host_report_subjects(node: str) -> tuple[str, ...]:
    """Each report subject a node agent produces, for one host (`node` may be the template's tag function).
    Listed one by one rather than `report.>`: a host then owns a fixed number of subjects, so a per-subject
    bound on its stream bounds all it can store."""
    addresses = sorted({s.address for s in MESSAGE_SPECS if NODE in s.producers and s.address is not None})
    stray = [a for a in addresses if not a.startswith(_HOST_REPORTS) and a not in HOST_TERMINAL_ADDRESSES]
    if stray:
        raise ValueError(f"node-agent messages outside its report and terminal subjects: {stray}")
    return tuple(a.replace("{node_id}", node) for a in addresses if a.startswith(_HOST_REPORTS))


_HOST_REPORTS = "gpuaas.node.{node_id}.report."
# The slice terminal's requests (a host relays a guest's bytes and asks for the tenant's keystrokes): outside the
# report stream, so a tenant's session is relayed, never stored; answered on the host's own inbox, so a host
# reads no other host's session. Listed one by one, never `terminal.>`.
HOST_TERMINAL_ADDRESSES = ("gpuaas.node.{node_id}.terminal.output", "gpuaas.node.{node_id}.terminal.input")


def host_terminal_subjects(node: str) -> tuple[str, ...]:
    return tuple(a.replace("{node_id}", node) for a in HOST_TERMINAL_ADDRESSES)


def requests_of(role: str) -> tuple[str, ...]:
    """Request/reply subjects `role` may ask on."""
    return tuple(sorted(s.address for s in MESSAGE_SPECS if s.reply and role in s.producers and s.address))


def requests_answered_by(service: str) -> tuple[str, ...]:
    """Request/reply subjects `service` answers: a core subscription (queue group), not a durable."""
    return tuple(sorted(_wild(s.address) for s in MESSAGE_SPECS if s.reply and service in s.consumers and s.address))


def durables_of(service: str) -> tuple[ConsumerSpec, ...]:
    return tuple(c for c in CONSUMERS if c.durable.startswith(f"{service}-"))


def followers_of(service: str) -> tuple[ConsumerSpec, ...]:
    return tuple(c for c in FOLLOWERS if c.durable.startswith(f"{service}-"))


def follower_rights(spec: ConsumerSpec) -> tuple[str, ...]:
    """A read model's consumer (`jetstream.FOLLOWERS`): made afresh from its own position at every start, so it
    may delete and create its one name with its one filter, and read the stream's info for its lag. It pulls
    with no acks: its position is in its own database."""
    s, d = spec.stream, spec.durable
    return (
        f"$JS.API.CONSUMER.CREATE.{s}.{d}.{spec.filter_subject}",
        f"$JS.API.CONSUMER.DELETE.{s}.{d}",
        f"$JS.API.CONSUMER.MSG.NEXT.{s}.{d}",
        f"$JS.API.CONSUMER.INFO.{s}.{d}",
        f"$JS.API.STREAM.INFO.{s}",
        f"gpuaas.dlq.{d}",
    )


def consumer_rights(spec: ConsumerSpec, *, may_create: bool, dead_letters: bool = True) -> tuple[str, ...]:
    """Fetch, ack and read the info of one durable; `dead_letters`: and dead-letter to `gpuaas.dlq.<durable>`
    (services only: a host's dead letters would be rows in ops' database at the host's own rate, and their
    bodies the host's to choose; a host counts what it could not handle instead)."""
    s, d = spec.stream, spec.durable
    rights = [
        f"$JS.API.CONSUMER.MSG.NEXT.{s}.{d}",
        f"$JS.ACK.{s}.{d}.>",
        f"$JS.API.CONSUMER.INFO.{s}.{d}",
    ]
    if dead_letters:
        rights.append(f"gpuaas.dlq.{d}")
    if may_create and not spec.admin_provisioned:
        rights.append(f"$JS.API.CONSUMER.CREATE.{s}.{d}.{spec.filter_subject}")
    return tuple(rights)


# The credential authority (services/credential-authority) is the one process that holds the signing keys. On
# the bus it keeps the identity ledger (a KV bucket): the revocation list, each slice host's users, each
# baremetal allocation's and the allocations that ended, read and written by compare-and-set. And it reads one
# message of the MAAS stream by its sequence: the deploy command a mint request names (it mints only for what the
# allocator's or the scheduler's own command asked). No consumer, no stream subject, nothing else of JetStream.
AUTHORITY = "credential-authority"
_KV = f"KV_{IDENTITY_BUCKET}"
IDENTITY_LEDGER_RIGHTS = (
    f"$JS.API.STREAM.INFO.{_KV}",
    f"$JS.API.STREAM.MSG.GET.{_KV}",
    f"$KV.{IDENTITY_BUCKET}.revocations",
    f"$KV.{IDENTITY_BUCKET}.hosts.*",
    f"$KV.{IDENTITY_BUCKET}.allocs.*",
    f"$KV.{IDENTITY_BUCKET}.nodes.*",
    f"$KV.{IDENTITY_BUCKET}.ended-allocations",
)
DEPLOY_COMMAND_READ = "$JS.API.STREAM.MSG.GET.MAAS"


def service_permissions(service: str) -> Permissions:
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    pub = list(produced_subjects(service))
    for spec in durables_of(service):
        # Bind only: the admin identity creates every durable (jetstream.provision). A right to create one's own,
        # even with its filter pinned, is a right to choose its every other field (ack wait, deliveries, policy).
        pub += consumer_rights(spec, may_create=False)
    for spec in followers_of(service):
        pub += follower_rights(spec)
    answers = requests_answered_by(service)
    return Permissions(
        pub_allow=tuple(pub),
        sub_allow=(*answers, f"{inbox_prefix(service)}.>"),
        replies=bool(answers),
        max_subs=CLIENT_MAX_SUBS,
    )


# Hosts live in an account of their own (authority.py: HOSTS) that imports what they may use from the account
# holding the streams. There the server's own JetStream responder answers every `$JS.API.` request that is no
# pull with "JetStream not enabled for account", so the one such request a host makes (its durable's info, at
# start) is imported under this prefix instead, and a host's JetStream context uses it (host_js_api).
HOST_JS_API = "$JS.GPUAAS.API"
_JS_API = "$JS.API"


def host_js_api(subject: str) -> str:
    """A host's local name for a GPUAAS JetStream API subject: pulls keep theirs (no responder of the server's
    own answers them), every other request goes under HOST_JS_API."""
    if subject.startswith(f"{_JS_API}.CONSUMER.MSG.NEXT.") or not subject.startswith(f"{_JS_API}."):
        return subject
    return HOST_JS_API + subject[len(_JS_API) :]


def gpuaas_subject(host_subject: str) -> str:
    """The subject in GPUAAS that a host's local subject is imported from (host_js_api undone)."""
    if host_subject.startswith(f"{HOST_JS_API}."):
        return _JS_API + host_subject[len(HOST_JS_API) :]
    return host_subject


def node_template(tag: str = NODE_TAG) -> Permissions:
    """The slice hosts' scoped signing key's template: every slice host user gets these, with its own node id
    filled in by the server from the JWT's `node:<id>` tag. The host cannot widen them: a user signed by a
    scoped key must carry no permissions of its own. The subjects are the host's, in the HOSTS account. No
    dead-letter subject: a host is out of the DLQ path (its agent counts what it could not handle)."""
    node = "{{tag(" + tag + ")}}"
    spec = node_agent_consumer(node)
    return Permissions(
        pub_allow=(
            *map(host_js_api, consumer_rights(spec, may_create=False, dead_letters=False)),
            *host_report_subjects(node),
            *host_terminal_subjects(node),
        ),
        sub_allow=(f"{inbox_prefix('{{name()}}')}.>",),
        max_payload=HOST_MAX_PAYLOAD,
        max_subs=HOST_MAX_SUBS,
    )


# What the agent of a baremetal tenant's host sends (services/node-agent, GPUAAS_ROLE=baremetal): its enrolment
# and nothing else. It pulls no task (a tenant's root machine has no task durable), relays no terminal and sends
# no slice report, so its user may do none of that: the tenant holds its creds file.
BAREMETAL_HOST_MESSAGES = ("node.enrolled",)
# Its one message is a few hundred bytes; its connection holds its PubAck inbox.
BAREMETAL_MAX_PAYLOAD = 16 * KIB
BAREMETAL_MAX_SUBS = 8


def baremetal_report_subjects(node: str) -> tuple[str, ...]:
    by_type = {s.type: s for s in MESSAGE_SPECS}
    addresses = [by_type[t].address for t in BAREMETAL_HOST_MESSAGES]
    if not all(a and a.startswith(_HOST_REPORTS) for a in addresses):
        raise ValueError(f"a baremetal host's messages must be its own reports: {addresses}")
    return tuple(str(a).replace("{node_id}", node) for a in addresses)


def baremetal_template(tag: str = NODE_TAG) -> Permissions:
    """The baremetal hosts' scoped signing key's template (an allocation-bound user, minted by the credential
    authority for a tenant's deploy): its own enrolment report and its own inbox, nothing of a slice host's."""
    node = "{{tag(" + tag + ")}}"
    return Permissions(
        pub_allow=baremetal_report_subjects(node),
        sub_allow=(f"{inbox_prefix('{{name()}}')}.>",),
        max_payload=BAREMETAL_MAX_PAYLOAD,
        max_subs=BAREMETAL_MAX_SUBS,
    )


def _filled(t: Permissions, node_id: str) -> Permissions:
    fill = lambda x: x.replace("{{tag(node)}}", node_id).replace("{{name()}}", node_user_name(node_id))  # noqa: E731
    return replace(t, pub_allow=tuple(map(fill, t.pub_allow)), sub_allow=tuple(map(fill, t.sub_allow)))


def node_permissions(node_id: str) -> Permissions:
    """What the slice template expands to for one host (used for documentation and tests)."""
    return _filled(node_template(), node_id)


def baremetal_permissions(node_id: str) -> Permissions:
    """What the baremetal template expands to for one host (used for documentation and tests)."""
    return _filled(baremetal_template(), node_id)


def node_user_name(node_id: str) -> str:
    return f"node-{node_id}"


ROLE_PERMISSIONS: dict[str, Permissions] = {
    **{s: service_permissions(s) for s in SERVICES},
    PORTAL: Permissions(
        pub_allow=produced_subjects(PORTAL),
        sub_allow=("gpuaas.allocation.event.>", f"{inbox_prefix(PORTAL)}.>"),
        max_payload=PORTAL_MAX_PAYLOAD,
        max_subs=CLIENT_MAX_SUBS,
    ),
    # Reads lifecycle, reports, dead letters and usage records live, and asks read-only queries; changes nothing.
    OPS: Permissions(
        pub_allow=requests_of(OPS),
        sub_allow=(
            f"{inbox_prefix(OPS)}.>",
            "gpuaas.allocation.event.>",
            "gpuaas.node.*.report.>",
            "gpuaas.dlq.>",
            "gpuaas.image.event.>",
            "gpuaas.scheduler.>",
            "gpuaas.usage.>",
        ),
        max_payload=OPS_MAX_PAYLOAD,
        max_subs=CLIENT_MAX_SUBS,
    ),
    AUTHORITY: Permissions(
        pub_allow=(*IDENTITY_LEDGER_RIGHTS, DEPLOY_COMMAND_READ),
        sub_allow=(f"{inbox_prefix(AUTHORITY)}.>",),
        max_subs=CLIENT_MAX_SUBS,
    ),
    # Break-glass: provisions streams and per-host consumers, issues ops commands. Never used by a service.
    ADMIN: Permissions(pub_allow=(">",), sub_allow=(">",)),
}


# nats-server's own payload limit, which holds where an identity has none of its own.
SERVER_MAX_PAYLOAD = 1024 * KIB


def max_payload_of(identity: str) -> int:
    """The largest message (headers included) the server takes from `identity`: a role or `node-<id>`."""
    perms = node_template() if identity.startswith("node-") else role_permissions(identity)
    return SERVER_MAX_PAYLOAD if perms.max_payload == UNLIMITED else min(perms.max_payload, SERVER_MAX_PAYLOAD)


def role_permissions(role: str) -> Permissions:
    try:
        return ROLE_PERMISSIONS[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(sorted(ROLE_PERMISSIONS))}") from None


def _durable_cell(spec: ConsumerSpec) -> str:
    return spec.durable


def _follower_cell(spec: ConsumerSpec) -> str:
    return f"{spec.durable} (follows {spec.filter_subject} from its own position)"


def render_table() -> str:
    """The README's identity table (markdown). A durable in the third column means: fetch, ack and read its
    info (`$JS.API.CONSUMER.{MSG.NEXT,INFO}`, `$JS.ACK`), and dead-letter to `gpuaas.dlq.<durable>`; nothing else
    of JetStream's API. The admin identity creates every durable; no service may create or change one."""
    code = lambda items: "<br>".join(f"`{i}`" for i in items) or "nothing"  # noqa: E731
    rows = ["| identity | publishes | consumes (own durables) | subscribes |", "|---|---|---|---|"]
    for service in SERVICES:
        replies = " and replies to requests it receives" if ROLE_PERMISSIONS[service].replies else ""
        rows.append(
            f"| `{service}` | {code(produced_subjects(service))}{replies} | "
            f"{code([*map(_durable_cell, durables_of(service)), *map(_follower_cell, followers_of(service))])}"
            f" | {code(ROLE_PERMISSIONS[service].sub_allow)} |"
        )
    rows.append(
        f"| `{PORTAL}` | {code(produced_subjects(PORTAL))} | nothing | {code(ROLE_PERMISSIONS[PORTAL].sub_allow)} |"
    )
    rows.append(
        f"| `{OPS}` | {code(ROLE_PERMISSIONS[OPS].pub_allow)} (read-only queries) | nothing | "
        f"{code(ROLE_PERMISSIONS[OPS].sub_allow)} |"
    )
    rows.append(
        f"| `{AUTHORITY}` (holds the signing keys; mints, renews and revokes) | "
        f"{code(ROLE_PERMISSIONS[AUTHORITY].pub_allow)} (the identity ledger; the deploy command a mint names, "
        "read by its MAAS stream sequence) | nothing | "
        f"{code(ROLE_PERMISSIONS[AUTHORITY].sub_allow)} |"
    )
    rows.append(f"| `{ADMIN}` (break-glass: provisioning, tests) | everything | everything | everything |")
    rows.append(
        "| `node-<node_id>` of a slice host (one per host, scoped signing key; "
        f"payload ≤ {HOST_MAX_PAYLOAD // KIB} KiB, ≤ {HOST_MAX_SUBS} subscriptions) | "
        f"{code([*host_report_subjects('<node_id>'), *host_terminal_subjects('<node_id>')])} | "
        "`node-agent-<node_id>` (no create, no dead letters) | `_INBOX_node-<node_id>.>` |"
    )
    rows.append(
        "| `node-<node_id>` of a baremetal tenant (one per allocation, its own scoped signing key; "
        f"payload ≤ {BAREMETAL_MAX_PAYLOAD // KIB} KiB, ≤ {BAREMETAL_MAX_SUBS} subscriptions) | "
        f"{code(baremetal_report_subjects('<node_id>'))} | nothing | `_INBOX_node-<node_id>.>` |"
    )
    return "\n".join(rows) + "\n"
