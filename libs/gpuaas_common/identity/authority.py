"""The trust chain of our NATS deployment: operator → accounts → users, and the keys that sign them.

- The **operator** identity key signs only the operator JWT; accounts are signed by an operator
  *signing key*, so the identity key can stay offline.
- Account **SYS** is the system account (claim updates and revocations travel through it).
- Account **GPUAAS** holds every stream and every user of the product but the hosts, signed by its plain
  signing key (service, portal, ops and admin users: their permissions are in the user JWT).
- Account **HOSTS** holds the hosts, signed by its **scoped** signing keys, whose templates grant each host its
  own subjects from the JWT's `node:<id>` tag: one key for slice hosts (`node_template`: its task durable, its
  reports, its terminal relay), one for baremetal tenants' hosts (`baremetal_template`: its enrolment only). It
  has no JetStream; it imports from GPUAAS, as services, only the subjects those templates name
  (`host_service_exports`). A host's request thus reaches GPUAAS with a reply
  subject the server made, and the answer (a PubAck, a JetStream API reply, a pulled message) comes back to
  the host in HOSTS on the reply subject it gave. In GPUAAS a host's reply subject would be where JetStream
  publishes its answer, whatever the host may publish itself: another host's task subject, a lifecycle event,
  each captured and stored by a stream (W9, tests/integration/test_bus_reply_reflection.py). In HOSTS it
  reaches no stream and nobody but the host's own account.
- The server runs the `full` resolver, so a new user needs no server change at all, and a revocation
  is an account JWT update pushed through the system account, applied at once without a restart.

`Authority` holds the secrets that sign; `Issuer` is the smaller set a service that mints host
credentials and revokes them needs (the MAAS gateway, for baremetal hosts).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import nkeys
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from ..jetstream import IDENTITY_BUCKET
from . import creds as creds_mod
from .creds import Creds
from .jwt import Key, decode, encode
from .permissions import (
    ADMIN,
    NODE,
    NODE_TAG,
    Permissions,
    baremetal_template,
    gpuaas_subject,
    node_template,
    node_user_name,
)

# The JetStream API subject a pull asks on: its answer is many messages (a service export's `Stream` response).
_PULL = "$JS.API.CONSUMER.MSG.NEXT."


def host_service_exports() -> tuple[tuple[str, str, str], ...]:
    """(subject in GPUAAS, subject in HOSTS, response type) of each service GPUAAS exports to HOSTS: the host
    templates' publish subjects with the host's own tokens as wildcards (a partial token cannot be one:
    `node-agent-<id>` becomes `*`). HOSTS imports them all; each host user may still publish only on its own,
    as its template says."""
    out: dict[str, tuple[str, str, str]] = {}
    for subject in (*node_template().pub_allow, *baremetal_template().pub_allow):
        local = ".".join("*" if "{{" in token else token for token in subject.split("."))
        remote = gpuaas_subject(local)
        out.setdefault(local, (remote, local, "Stream" if remote.startswith(_PULL) else "Singleton"))
    return tuple(out.values())


ACCOUNT_NAME = "GPUAAS"
HOSTS_ACCOUNT_NAME = "HOSTS"
# The label of the baremetal hosts' scoped key in the HOSTS account JWT (the slice hosts' is NODE).
BAREMETAL_ROLE = "baremetal-host"

T = TypeVar("T")


async def _through_account_updates(call: Callable[[], Awaitable[T]]) -> T:
    """A JetStream API call in the GPUAAS account, tried again while the account's JetStream is re-applied:
    for a moment after an account JWT update (ours, or another revoker's) the server has no responder for the
    account's API (`no responders`), or one that times out. Seen in the suite with 8 revokers at once."""
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type((nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError)),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        stop=stop_after_delay(15),
        reraise=True,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity re-raises the last error")


SYS_NAME = "SYS"
# JetStream on, unlimited within the account: the server's own limits and the stream configs bound it.
JETSTREAM_LIMITS = {
    "mem_storage": -1,
    "disk_storage": -1,
    "streams": -1,
    "consumer": -1,
    "max_ack_pending": -1,
    "mem_max_stream_bytes": -1,
    "disk_max_stream_bytes": -1,
    "max_bytes_required": False,
}
ACCOUNT_LIMITS = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}
# The ledger forgets a revocation this old (see Issuer.revoke), so no user may live longer.
MAX_USER_TTL_S = 365 * 24 * 3600.0
# Services, portal and ops live a day: their files are issued again at half-life (`identity.rotation`, run by
# `gpuaas identities renew` or the dev stack) and a running service switches to them without a gap
# (`creds_renewal`). A leaked file is worth a day at most.
DEFAULT_USER_TTL_S = 24 * 3600.0
# Slice hosts live three days, renewed at half-life the same way: a host its renewed file cannot reach for a
# while (ops' delivery to the host, a host down) keeps working for a day and a half more.
HOST_USER_TTL_S = 72 * 3600.0
# Admin is break-glass and one-shot steps (provisioning, onboarding, an ops command): a leaked file is worth a
# working day at most, and whoever needs admin again mints it again from the keys.
ADMIN_USER_TTL_S = 12 * 3600.0
# The system user: minted by the credential authority for each revocation it pushes (`Authority.issuer`), so it
# lives only as long as one push may take; it may ask for and replace account JWTs and nothing else of $SYS.
SYS_USER_TTL_S = 3600.0
SYS_INBOX = "_INBOX_authority"
SYS_PERMISSIONS = Permissions(
    pub_allow=("$SYS.REQ.ACCOUNT.*.CLAIMS.LOOKUP", "$SYS.REQ.ACCOUNT.*.CLAIMS.UPDATE"),
    sub_allow=(f"{SYS_INBOX}.>",),
)
# The revocation ledger: a JetStream KV entry in the GPUAAS account, written by compare-and-set.
REVOCATIONS_BUCKET = IDENTITY_BUCKET
REVOCATIONS_KEY = "revocations"
# Slice hosts' users, per host (`host_users_key`): written by whoever onboards a host (as admin), read by
# whoever must end the host's slice identity (the gateway, before the host is deployed for a tenant).
HOST_USERS_PREFIX = "hosts."


def host_users_key(node_id: str) -> str:
    # KV keys take fewer characters than node ids do (no ':'); the encoding is reversible and stable.
    return HOST_USERS_PREFIX + base64.urlsafe_b64encode(node_id.encode()).decode().rstrip("=")


# Baremetal hosts' users, per allocation: written and read by the credential authority alone.
ALLOCATION_USERS_PREFIX = "allocs."


def allocation_users_key(allocation_id: str) -> str:
    return ALLOCATION_USERS_PREFIX + base64.urlsafe_b64encode(allocation_id.lower().encode()).decode().rstrip("=")


# Baremetal allocations whose host users the credential authority revoked (released, or their deploy failed):
# allocation id → ended at (unix seconds), one entry written by compare-and-set. A mint for an ended allocation is
# refused. Marks are pruned at each write once older than the writer's `keep_s`: past the deploy command age limit
# every command of an allocation that ended is refused as old anyway, so the entry holds only the allocations ended
# within that limit.
ENDED_ALLOCATIONS_KEY = "ended-allocations"


# Every host user the credential authority minted for a node, per node (baremetal and slice-host alike): the one
# key a mint claims the node by (compare-and-set), so no two live users of a node are minted, whichever replica.
NODE_USERS_PREFIX = "nodes."


def node_users_key(node_id: str) -> str:
    return NODE_USERS_PREFIX + base64.urlsafe_b64encode(node_id.encode()).decode().rstrip("=")


class NodeHasLiveUser(RuntimeError):
    """A mint for a node that has a live (unexpired, unrevoked) host user: nothing was minted."""

    def __init__(self, node_id: str, users: list[str]) -> None:
        super().__init__(f"node {node_id} has {len(users)} live host user(s): end them first")
        self.node_id, self.users = node_id, users


async def node_users(js: Any, node_id: str) -> list[str]:
    """The unexpired users the credential authority minted for `node_id` (revoked ones included)."""
    return await _users_at(js, node_users_key(node_id))


async def live_node_users(js: Any, node_id: str) -> list[str]:
    """Every unexpired, unrevoked host user of `node_id`: minted by the authority, onboarded or renewed."""
    revoked = await revoked_users(js)
    users = dict.fromkeys([*await host_users(js, node_id), *await node_users(js, node_id)])
    return [u for u in users if u not in revoked]


async def _entry_at(kv: Any, key: str) -> tuple[dict[str, int | None], int | None]:
    """A host or node entry's users and the revision a compare-and-set writes against (None: no entry yet)."""
    from nats.js.errors import KeyNotFoundError

    try:
        entry = await _through_account_updates(lambda: kv.get(key))
    except KeyNotFoundError:
        return {}, None
    return _host_entry(entry.value), entry.revision


async def claim_node(js: Any, node_id: str, user_public: str, expires_at: int, *, attempts: int = 20) -> None:
    """Record `user_public` as the node's one live user, by compare-and-set on the node's entry: raises
    NodeHasLiveUser (nothing written) where the node has a live user already, its onboarded or renewed slice
    users included. Two mints racing for a node: one writes, the other reads again and is refused."""
    from nats.js.errors import KeyWrongLastSequenceError

    key = node_users_key(node_id)
    kv = await _through_account_updates(lambda: js.key_value(REVOCATIONS_BUCKET))
    for _ in range(attempts):
        users, revision = await _entry_at(kv, key)
        users = _live(users, time.time())
        revoked = await revoked_users(js)
        live = [u for u in dict.fromkeys([*users, *await host_users(js, node_id)]) if u not in revoked]
        if live:
            raise NodeHasLiveUser(node_id, live)
        # Revoked users leave the entry: they are in the revocation list, which keeps them out.
        users = {u: exp for u, exp in users.items() if u not in revoked}
        users[user_public] = expires_at
        data = json.dumps(users).encode()
        try:
            if revision is None:
                await _through_account_updates(lambda d=data: kv.create(key, d))
            else:
                await _through_account_updates(lambda d=data, r=revision: kv.update(key, d, last=r))
            return
        except KeyWrongLastSequenceError:
            continue
    raise AuthorityError(f"could not claim node {node_id}: too much contention")


def _host_entry(value: bytes | None) -> dict[str, int | None]:
    """A host's entry: user public key → expiry (unix seconds), None where unknown (entries written as a plain
    list before expiries were kept). A reader that takes the entry as a list of keys still reads the keys."""
    loaded = json.loads(value or b"[]")
    return dict(loaded) if isinstance(loaded, dict) else dict.fromkeys(loaded)


def _live(entry: dict[str, int | None], now: float) -> dict[str, int | None]:
    # An expired user needs no revocation: the server refuses it anyway. Dropping it keeps the entry (and the
    # revocations pushed from it) as small as the host's live users, however often the host was renewed.
    return {u: exp for u, exp in entry.items() if exp is None or exp > now}


async def host_users(js: Any, node_id: str) -> list[str]:
    """Every slice-host user recorded for `node_id` that has not expired (empty when none was)."""
    return await _users_at(js, host_users_key(node_id))


async def record_host_users(
    js: Any,
    node_id: str,
    user_publics: list[str],
    *,
    expiry: dict[str, int] | None = None,
    attempts: int = 20,
) -> list[str]:
    """Add slice-host users of `node_id` to its entry, by compare-and-set (two onboardings lose nothing), with
    their expiry where `expiry` knows it; expired users leave the entry. Returns the users as written."""
    return await _record_users(js, host_users_key(node_id), user_publics, expiry=expiry, attempts=attempts)


async def allocation_users(js: Any, allocation_id: str) -> list[str]:
    """The baremetal host users minted for `allocation_id` that have not expired."""
    return await _users_at(js, allocation_users_key(allocation_id))


async def record_allocation_users(
    js: Any, allocation_id: str, user_publics: list[str], *, expiry: dict[str, int]
) -> list[str]:
    """Recorded by the credential authority before a minted user leaves it: what it may revoke for the allocation
    is what it minted for it, never a key a caller names."""
    return await _record_users(js, allocation_users_key(allocation_id), user_publics, expiry=expiry)


async def ended_allocations(js: Any) -> dict[str, int]:
    """The allocations marked ended (`end_allocation`) and not yet pruned: allocation id → ended at."""
    from nats.js.errors import KeyNotFoundError

    kv = await _through_account_updates(lambda: js.key_value(REVOCATIONS_BUCKET))
    try:
        entry = await _through_account_updates(lambda: kv.get(ENDED_ALLOCATIONS_KEY))
    except KeyNotFoundError:
        return {}
    return dict(json.loads(entry.value or b"{}"))


async def end_allocation(js: Any, allocation_id: str, *, keep_s: float, attempts: int = 20) -> bool:
    """Mark `allocation_id` ended, by compare-and-set (two revokers lose nothing), pruning the marks older than
    `keep_s`. An allocation marked already keeps its first time and nothing is written. True when written now."""
    from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

    allocation = allocation_id.lower()
    kv = await _through_account_updates(lambda: js.key_value(REVOCATIONS_BUCKET))
    for _ in range(attempts):
        try:
            entry = await _through_account_updates(lambda: kv.get(ENDED_ALLOCATIONS_KEY))
            ended, revision = dict(json.loads(entry.value or b"{}")), entry.revision
        except KeyNotFoundError:
            ended, revision = {}, None
        if allocation in ended:
            return False
        now = int(time.time())
        ended = {a: at for a, at in ended.items() if at >= now - keep_s}
        ended[allocation] = now
        data = json.dumps(ended, sort_keys=True).encode()
        try:
            if revision is None:
                await _through_account_updates(lambda d=data: kv.create(ENDED_ALLOCATIONS_KEY, d))
            else:
                await _through_account_updates(lambda d=data, r=revision: kv.update(ENDED_ALLOCATIONS_KEY, d, last=r))
            return True
        except KeyWrongLastSequenceError:
            continue
    raise AuthorityError(f"could not mark allocation {allocation} ended: too much contention")


async def _users_at(js: Any, key: str) -> list[str]:
    from nats.js.errors import KeyNotFoundError

    kv = await _through_account_updates(lambda: js.key_value(REVOCATIONS_BUCKET))
    try:
        entry = await _through_account_updates(lambda: kv.get(key))
    except KeyNotFoundError:
        return []
    return list(_live(_host_entry(entry.value), time.time()))


async def _record_users(
    js: Any, key: str, user_publics: list[str], *, expiry: dict[str, int] | None, attempts: int = 20
) -> list[str]:
    from nats.js.errors import KeyWrongLastSequenceError

    kv = await _through_account_updates(lambda: js.key_value(REVOCATIONS_BUCKET))
    for _ in range(attempts):
        users, revision = await _entry_at(kv, key)
        users.update({u: (expiry or {}).get(u) for u in user_publics if u not in users or users[u] is None})
        users = _live(users, time.time())
        data = json.dumps(users).encode()
        try:
            if revision is None:
                await _through_account_updates(lambda d=data: kv.create(key, d))
            else:
                await _through_account_updates(lambda d=data, r=revision: kv.update(key, d, last=r))
            return list(users)
        except KeyWrongLastSequenceError:
            continue
    raise AuthorityError(f"could not record the users under {key}: too much contention")


async def revoked_users(js: Any) -> dict[str, int]:
    """The revocation ledger as recorded (user public key → revoked at, unix seconds)."""
    from nats.js.errors import KeyNotFoundError

    kv = await _through_account_updates(lambda: js.key_value(REVOCATIONS_BUCKET))
    try:
        entry = await _through_account_updates(lambda: kv.get(REVOCATIONS_KEY))
    except KeyNotFoundError:
        return {}
    return dict(json.loads(entry.value or b"{}"))


class AuthorityError(RuntimeError):
    """A claim update the server refused or did not confirm."""


def _user_claims(account_public: str, *, permissions: Permissions | None, tags: list[str]) -> dict[str, Any]:
    nats: dict[str, Any] = {"type": "user", "issuer_account": account_public, "tags": tags}
    if permissions is not None:
        nats.update(permissions.claims())
    return nats


def _node_creds(
    node_signing: Key, account_public: str, node_id: str, *, ttl_s: float, allocation_id: str | None = None
) -> Creds:
    """A host user signed by a scoped key (the slice hosts' or the baremetal hosts'; the key decides the
    template): no permissions of its own, its node (and allocation) as tags."""
    user = Key.generate("user")
    tags = [f"{NODE_TAG}:{node_id}"] + ([f"allocation:{allocation_id.lower()}"] if allocation_id else [])
    jwt = encode(
        node_signing,
        user.public,
        node_user_name(node_id),
        _user_claims(account_public, permissions=None, tags=tags),
        expires_at=time.time() + ttl_s,
    )
    return Creds(jwt=jwt, seed=user.seed)


@dataclass
class Issuer:
    """Signs baremetal hosts' users with their scoped key and revokes users through the system account."""

    account_public: str
    operator_signing: Key
    node_signing: Key
    sys_creds: Creds
    # The HOSTS account, whose scoped key `node_signing` is; None in an issuer file made before it existed.
    hosts_account_public: str | None = None
    # The baremetal hosts' scoped key (`baremetal_template`); None in an issuer file made before it existed.
    baremetal_signing: Key | None = None

    def _hosts(self) -> str:
        if self.hosts_account_public is None:
            raise AuthorityError("this issuer file predates the HOSTS account: write it again from the keys")
        return self.hosts_account_public

    def issue_node(self, node_id: str, *, ttl_s: float, allocation_id: str | None = None) -> Creds:
        """A baremetal tenant's host user: signed by the baremetal key, so it has the baremetal template (its
        enrolment only), never a slice host's task queue, terminal or reports."""
        hosts = self._hosts()
        if self.baremetal_signing is None:
            raise AuthorityError("this issuer file predates the baremetal hosts' key: write it again from the keys")
        return _node_creds(self.baremetal_signing, hosts, node_id, ttl_s=ttl_s, allocation_id=allocation_id)

    async def end_slice_identity(self, nats_servers: list[str], node_id: str, *, js: Any, tls: Any = None) -> int:
        """Revoke every slice-host user recorded for the host that is not revoked yet: before a tenant gets root
        on the disk that holds its creds file. Returns how many were revoked now (0: nothing left to do, and
        nothing pushed). Every user the credential authority minted for the node goes too (a baremetal tenant's
        from an earlier deploy, or this deploy's from a try that did not reach MAAS): the next mint finds none
        live."""
        live = await live_node_users(js, node_id)
        if live:
            await self.revoke(nats_servers, live, js=js, tls=tls)
        return len(live)

    # --- revocation ---------------------------------------------------------------------------------

    async def revoke(
        self,
        nats_servers: list[str],
        user_publics: list[str],
        *,
        js: Any,
        tls: Any = None,
        prune_older_than_s: float | None = MAX_USER_TTL_S,
        attempts: int = 20,
    ) -> int:
        """Revoke users at once, safely against other revokers (gateway replicas, an ops command).

        Pushing an account JWT replaces the one the servers hold, so two writers that each read, add
        and push can lose each other's revocations. The list therefore lives in a JetStream KV entry
        (`js`: a connection in the GPUAAS account allowed to use it) updated by compare-and-set, and
        the account JWT pushed is always built from the newest revision: a writer pushes, reads the
        revision again and pushes once more if someone wrote in between, so the last push carries
        everything. Returns how many users are revoked in total."""
        import nats
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        kv = await _through_account_updates(lambda: js.key_value(REVOCATIONS_BUCKET))
        nc = await nats.connect(
            servers=nats_servers,
            user_credentials=nats.aio.client.RawCredentials(self.sys_creds.render()),
            # TLS first, as every client of ours: the servers accept nothing else.
            **({"tls": tls, "tls_handshake_first": True} if tls is not None else {}),
            connect_timeout=5,
            max_reconnect_attempts=3,
            name="gpuaas-authority",
            inbox_prefix=SYS_INBOX.encode(),
        )
        try:
            for _ in range(attempts):  # 1: record, by compare-and-set
                try:
                    entry = await _through_account_updates(lambda: kv.get(REVOCATIONS_KEY))
                    revs, revision = json.loads(entry.value), entry.revision
                except KeyNotFoundError:
                    # First use: start from what the servers hold, so nothing revoked before is dropped.
                    revs = {}
                    for account in self._accounts():
                        revs.update(decode(await self._lookup(nc, account))["nats"].get("revocations") or {})
                    revision = None
                now = int(time.time())
                revs.update({pk: now for pk in user_publics})
                if prune_older_than_s is not None:
                    # A revocation older than the longest user lifetime covers only expired JWTs.
                    revs = {k: v for k, v in revs.items() if v >= now - prune_older_than_s}
                data = json.dumps(revs, sort_keys=True).encode()
                try:
                    if revision is None:
                        await _through_account_updates(lambda d=data: kv.create(REVOCATIONS_KEY, d))
                    else:
                        await _through_account_updates(lambda d=data, r=revision: kv.update(REVOCATIONS_KEY, d, last=r))
                    break
                except KeyWrongLastSequenceError:
                    continue  # another revoker wrote first: merge into theirs
            else:
                raise AuthorityError(f"could not record {len(user_publics)} revocation(s): too much contention")
            for _ in range(attempts):  # 2: the servers get the newest revision, whoever pushes it
                entry = await _through_account_updates(lambda: kv.get(REVOCATIONS_KEY))
                # Both accounts carry the whole list: hosts' users are in HOSTS, everyone else's in GPUAAS.
                for account in self._accounts():
                    current = await self._lookup(nc, account)
                    await self._push(nc, account, self._with_revocations(current, json.loads(entry.value)))
                if (await _through_account_updates(lambda: kv.get(REVOCATIONS_KEY))).revision == entry.revision:
                    return len(json.loads(entry.value))
            raise AuthorityError("the revocation list kept changing while it was pushed")
        finally:
            await nc.close()

    def _with_revocations(self, current_jwt: str, revocations: dict[str, int]) -> str:
        claims = decode(current_jwt)
        nats_claims = {k: v for k, v in claims["nats"].items() if k != "version"}
        nats_claims["revocations"] = revocations
        # A later iat than the stored JWT's, or resolvers that sync keep the older one.
        iat = max(int(time.time()), int(claims["iat"]) + 1)
        return encode(self.operator_signing, claims["sub"], claims["name"], nats_claims, issued_at=iat)

    def _accounts(self) -> tuple[str, ...]:
        return (self.account_public,) + ((self.hosts_account_public,) if self.hosts_account_public else ())

    async def _lookup(self, nc: Any, account: str) -> str:
        msg = await nc.request(f"$SYS.REQ.ACCOUNT.{account}.CLAIMS.LOOKUP", b"", timeout=5)
        text = msg.data.decode()
        if not text.startswith("eyJ"):
            raise AuthorityError(f"account lookup failed: {text[:200]}")
        return text

    async def _push(self, nc: Any, account: str, jwt: str) -> None:
        msg = await nc.request(f"$SYS.REQ.ACCOUNT.{account}.CLAIMS.UPDATE", jwt.encode(), timeout=5)
        reply = json.loads(msg.data or b"{}")
        if "error" in reply or (reply.get("data") or {}).get("code") != 200:
            raise AuthorityError(f"account update refused: {reply.get('error') or reply}")

    # --- files --------------------------------------------------------------------------------------

    def dump(self) -> str:
        return json.dumps(
            {
                "account_public": self.account_public,
                "hosts_account_public": self.hosts_account_public,
                "operator_signing_seed": self.operator_signing.seed.decode(),
                "node_signing_seed": self.node_signing.seed.decode(),
                "baremetal_signing_seed": self.baremetal_signing.seed.decode() if self.baremetal_signing else None,
                "sys_creds": self.sys_creds.render(),
            }
        )

    @classmethod
    def load(cls, path: Path | str) -> "Issuer":
        d = json.loads(Path(path).read_text())
        return cls(
            d["account_public"],
            Key.from_seed(d["operator_signing_seed"]),
            Key.from_seed(d["node_signing_seed"]),
            creds_mod.parse(d["sys_creds"]),
            d.get("hosts_account_public"),
            Key.from_seed(d["baremetal_signing_seed"]) if d.get("baremetal_signing_seed") else None,
        )

    def __repr__(self) -> str:
        return f"Issuer(account={self.account_public!r})"


@dataclass
class Authority:
    """Every key of a deployment; created once (`create`), kept in a 0600 directory (`save`/`load`)."""

    operator: Key
    operator_signing: Key
    sys_account: Key
    account: Key
    account_signing: Key
    node_signing: Key
    issued_hosts: dict[str, list[str]] = field(default_factory=dict)
    # The `iat` of every JWT the servers preload, fixed when the keys are made: a server (re)started with the
    # config rendered again keeps the account JWT a revocation pushed (always later), since the resolver
    # replaces a stored JWT only with a newer one. A fresh `iat` at each render would bring revoked users back.
    issued_at: int = field(default_factory=lambda: int(time.time()))
    # The HOSTS account's identity key (its JWT is signed by the operator's signing key, its users by
    # `node_signing`). Keys saved before it existed derive it from the GPUAAS account's seed (`load`).
    hosts_account: Key = field(default_factory=lambda: Key.generate("account"))
    # Expiry (unix seconds) of each host user in `issued_hosts`; users issued before it was kept have none.
    host_expiry: dict[str, int] = field(default_factory=dict)
    # The HOSTS account's second scoped key: baremetal tenants' hosts (`baremetal_template`). Keys saved before
    # it existed derive it from the GPUAAS account's seed (`load`).
    baremetal_signing: Key = field(default_factory=lambda: Key.generate("account"))

    @classmethod
    def create(cls) -> "Authority":
        return cls(
            Key.generate("operator"),
            Key.generate("operator"),
            Key.generate("account"),
            Key.generate("account"),
            Key.generate("account"),
            Key.generate("account"),
        )

    # --- JWTs ---------------------------------------------------------------------------------------

    def operator_jwt(self) -> str:
        return encode(
            self.operator,
            self.operator.public,
            "gpuaas",
            {
                "type": "operator",
                "signing_keys": [self.operator_signing.public],
                "system_account": self.sys_account.public,
            },
            issued_at=self.issued_at,
        )

    def sys_account_jwt(self) -> str:
        return encode(
            self.operator_signing,
            self.sys_account.public,
            SYS_NAME,
            {
                "type": "account",
                "limits": {**ACCOUNT_LIMITS},
                "signing_keys": [],
            },
            issued_at=self.issued_at,
        )

    def account_jwt(self, revocations: dict[str, int] | None = None) -> str:
        exports = [
            {"name": f"hosts {subject}", "subject": subject, "type": "service", "response_type": response}
            for subject, _, response in host_service_exports()
        ]
        return encode(
            self.operator_signing,
            self.account.public,
            ACCOUNT_NAME,
            {
                "type": "account",
                "limits": {**ACCOUNT_LIMITS, **JETSTREAM_LIMITS},
                "signing_keys": [self.account_signing.public],
                "exports": exports,
                "revocations": revocations or {},
            },
            issued_at=self.issued_at,
        )

    def hosts_account_jwt(self, revocations: dict[str, int] | None = None) -> str:
        """HOSTS: no JetStream of its own, the GPUAAS services the host templates allow imported, a scoped key per
        kind of host (slice hosts; baremetal tenants' hosts)."""
        # With the host limits: a scoped key's user carries none itself.
        template, baremetal = node_template().claims(), baremetal_template().claims()
        imports = [
            {
                "name": f"gpuaas {subject}",
                "subject": subject,
                "account": self.account.public,
                "local_subject": local,
                "type": "service",
            }
            for subject, local, _ in host_service_exports()
        ]
        return encode(
            self.operator_signing,
            self.hosts_account.public,
            HOSTS_ACCOUNT_NAME,
            {
                "type": "account",
                "limits": {**ACCOUNT_LIMITS},
                "signing_keys": [
                    {
                        "kind": "user_scope",
                        "key": self.node_signing.public,
                        "role": NODE,
                        "template": template,
                        "description": "one user per slice host; its subjects come from the node tag",
                    },
                    {
                        "kind": "user_scope",
                        "key": self.baremetal_signing.public,
                        "role": BAREMETAL_ROLE,
                        "template": baremetal,
                        "description": "one user per baremetal allocation's host: its enrolment only",
                    },
                ],
                "imports": imports,
                "revocations": revocations or {},
            },
            issued_at=self.issued_at,
        )

    def server_config(self, resolver_dir: Path) -> str:
        """The operator-mode block of a nats-server config (the rest is the caller's)."""
        preload = {
            self.sys_account.public: self.sys_account_jwt(),
            self.account.public: self.account_jwt(),
            self.hosts_account.public: self.hosts_account_jwt(),
        }
        lines = [
            f"operator: {self.operator_jwt()}",
            f"system_account: {self.sys_account.public}",
            "resolver: {",
            "  type: full",
            f"  dir: {json.dumps(str(resolver_dir))}",
            "  allow_delete: false",
            '  interval: "2m"',
            '  timeout: "2s"',
            "}",
            "resolver_preload: {",
            *(f"  {k}: {v}" for k, v in preload.items()),
            "}",
        ]
        return "\n".join(lines) + "\n"

    # --- users --------------------------------------------------------------------------------------

    def issue_user(self, name: str, permissions: Permissions, *, ttl_s: float | None = None) -> Creds:
        if ttl_s is None:
            ttl_s = ADMIN_USER_TTL_S if name == ADMIN else DEFAULT_USER_TTL_S
        user = Key.generate("user")
        jwt = encode(
            self.account_signing,
            user.public,
            name,
            _user_claims(self.account.public, permissions=permissions, tags=[f"role:{name}"]),
            expires_at=time.time() + ttl_s,
        )
        return Creds(jwt=jwt, seed=user.seed)

    def issue_sys_user(self, *, ttl_s: float = SYS_USER_TTL_S) -> Creds:
        user = Key.generate("user")
        jwt = encode(
            self.sys_account,
            user.public,
            "sys",
            {"type": "user", "tags": [], **SYS_PERMISSIONS.claims()},
            expires_at=time.time() + ttl_s,
        )
        return Creds(jwt=jwt, seed=user.seed)

    def issuer(self) -> Issuer:
        return Issuer(
            self.account.public,
            self.operator_signing,
            self.node_signing,
            self.issue_sys_user(),
            self.hosts_account.public,
            self.baremetal_signing,
        )

    def issue_host(self, node_id: str, *, ttl_s: float = HOST_USER_TTL_S) -> Creds:
        """A slice host's credentials at onboarding or renewal; the key is remembered (with its expiry) so
        decommissioning revokes it, and the host's users that have expired are forgotten. Record it on the bus
        too (`record_host_users` with `host_expiry`), so the gateway can end the host's slice identity before
        the host is handed to a tenant."""
        if ttl_s > MAX_USER_TTL_S:
            raise ValueError(f"a host user may live {MAX_USER_TTL_S / 86400:.0f} days at most (the ledger's memory)")
        c = _node_creds(self.node_signing, self.hosts_account.public, node_id, ttl_s=ttl_s)
        now = time.time()
        users = [u for u in self.issued_hosts.get(node_id, []) if self.host_expiry.get(u, now + 1) > now]
        for gone in set(self.issued_hosts.get(node_id, [])) - set(users):
            self.host_expiry.pop(gone, None)
        self.issued_hosts[node_id] = [*users, str(c.claims["sub"])]
        self.host_expiry[str(c.claims["sub"])] = int(c.claims["exp"])
        return c

    # --- files --------------------------------------------------------------------------------------

    _FILES = ("operator", "operator_signing", "sys_account", "account", "account_signing", "node_signing")
    _HOSTS_FILE = "hosts_account.nk"
    _BAREMETAL_FILE = "baremetal_signing.nk"

    def save(self, keys_dir: Path) -> None:
        keys_dir.mkdir(parents=True, exist_ok=True)
        keys_dir.chmod(0o700)
        for name in self._FILES:
            creds_mod.write_secret(keys_dir / f"{name}.nk", getattr(self, name).seed.decode() + "\n")
        creds_mod.write_secret(keys_dir / self._HOSTS_FILE, self.hosts_account.seed.decode() + "\n")
        creds_mod.write_secret(keys_dir / self._BAREMETAL_FILE, self.baremetal_signing.seed.decode() + "\n")
        creds_mod.write_secret(keys_dir / "issued-hosts.json", json.dumps(self.issued_hosts, indent=2))
        creds_mod.write_secret(keys_dir / "issued-hosts-expiry.json", json.dumps(self.host_expiry, indent=2))
        creds_mod.write_secret(keys_dir / "issued-at", f"{self.issued_at}\n")

    @classmethod
    def load(cls, keys_dir: Path) -> "Authority":
        keys = [Key.from_seed((keys_dir / f"{name}.nk").read_text().strip()) for name in cls._FILES]
        issued_path = keys_dir / "issued-hosts.json"
        issued = json.loads(issued_path.read_text()) if issued_path.exists() else {}
        expiry_path = keys_dir / "issued-hosts-expiry.json"
        expiry = json.loads(expiry_path.read_text()) if expiry_path.exists() else {}
        at_path = keys_dir / "issued-at"
        # Keys saved before the file existed: the account key's own age is as fixed as the keys are.
        issued_at = int(at_path.read_text()) if at_path.exists() else int((keys_dir / "account.nk").stat().st_mtime)
        hosts_path = keys_dir / cls._HOSTS_FILE
        hosts = (
            Key.from_seed(hosts_path.read_text().strip()) if hosts_path.exists() else _derived_hosts_account(keys[3])
        )
        baremetal_path = keys_dir / cls._BAREMETAL_FILE
        baremetal = (
            Key.from_seed(baremetal_path.read_text().strip())
            if baremetal_path.exists()
            else _derived_key(keys[3], b"gpuaas baremetal hosts signing key\0")
        )
        return cls(
            *keys,
            issued_hosts=issued,
            issued_at=issued_at,
            hosts_account=hosts,
            host_expiry=expiry,
            baremetal_signing=baremetal,
        )

    def __repr__(self) -> str:
        return f"Authority(operator={self.operator.public!r}, account={self.account.public!r})"


def _derived_hosts_account(account: Key) -> Key:
    """The HOSTS account of keys saved before it existed: derived from the GPUAAS account's seed (same secret,
    same directory), so every process loading those keys agrees on it without writing to them."""
    return _derived_key(account, b"gpuaas HOSTS account\0")


def _derived_key(account: Key, purpose: bytes) -> Key:
    raw = hashlib.sha256(purpose + account.seed).digest()
    return Key.from_seed(nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_ACCOUNT))
