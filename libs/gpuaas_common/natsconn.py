"""How every process of ours connects to NATS: as an identity, over TLS, with replies on its own inbox.

One place builds the options of the one connection a service uses (publishing, the outbox relay and every
consumer's pulls). A refused credential (expired,
revoked, malformed, signed by someone else) is logged once as a structured warning that carries the
server's reason and never the secret; the process keeps running and keeps retrying, because nats-py
re-reads the creds file on every attempt and ops may replace it. A session the server ends with -ERR
(user revoked or expired while connected) is closed for good by nats-py: that is logged the same way,
and the process keeps running without that connection.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nkeys
from nats.aio.client import Client as NatsClient
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_never, wait_exponential

from .identity import creds as creds_mod
from .identity.jwt import JwtError
from .identity.permissions import inbox_prefix
from .identity.tls import client_context, client_tls_options
from .logging import get_logger

log = get_logger(__name__)


def _drop_tls_eof_noise(record: logging.LogRecord) -> bool:
    # asyncio warns on every TLS connection the server closes (a CPython quirk, not a fault of ours); it
    # would be the one non-JSON line in a service log and noise in every CLI run.
    return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_drop_tls_eof_noise)

# nats-py words the same refusal differently on different paths ("authorization failed" is its own text
# for the server's Authorization Violation).
AUTH_MARKERS = ("authorization violation", "authorization failed", "authentication expired", "authentication revoked")


def is_auth_refusal(text: str) -> bool:
    return any(m in text.lower() for m in AUTH_MARKERS)


def split_servers(urls: str) -> list[str]:
    """`tls://a:4222,tls://b:4222` — every seed of a cluster, so a client survives any one server."""
    return [u.strip() for u in urls.split(",") if u.strip()]


class CredentialError(RuntimeError):
    """Our own creds file cannot be used (missing, unreadable, malformed); the reason never holds the seed."""


class InsecureTransport(RuntimeError):
    """A plaintext or unpinned bus connection asked for without the explicit insecure-dev setting."""


INSECURE_HINT = "GPUAAS_NATS_INSECURE_DEV=true (--insecure-dev) allows it on a dev bus only"


def transport_refusal(servers: list[str], ca_file: str | None, insecure_dev: bool) -> str | None:
    """Why these options may not be used, or None. A nats:// URL would let anyone on the path strip TLS
    (nats-py upgrades only when the server's first line asks for it) and relay our signed nonce; a tls://
    URL without our CA would trust any public CA. Neither names the URL: it may carry a password."""
    if insecure_dev:
        return None
    if not servers or any(not s.startswith("tls://") for s in servers):
        return f"a nats:// URL is plaintext: every NATS URL must be tls://; {INSECURE_HINT}"
    if not ca_file:
        return f"tls:// needs GPUAAS_NATS_CA_FILE, the one CA trusted for the NATS servers; {INSECURE_HINT}"
    return None


@dataclass
class NatsIdentity:
    servers: list[str]
    creds_file: str | None = None
    ca_file: str | None = None
    # Plaintext or unpinned TLS allowed: only an open dev bus says so, by name.
    insecure_dev: bool = False
    _name: str | None = field(default=None, repr=False)
    _warned: set[str] = field(default_factory=set, repr=False)
    # The newest error of any connection attempt, and the newest auth refusal since we were last connected
    # (neither holds a secret): what a start-up that gives up reports. A refusal is often followed by
    # transport errors of the closed socket, so it is kept apart.
    last_error: str | None = field(default=None, repr=False)
    last_refusal: str | None = field(default=None, repr=False)
    # How often a connection made by `connect` looks at its creds file for renewed credentials
    # (`creds_renewal`): a stat of one file.
    creds_check_interval_s: float = 5.0
    # The credentials of the live session (what the server last accepted), and those read for the attempt
    # under way: one read of the file per attempt, so the JWT and the seed always come from the same version.
    session: creds_mod.Creds | None = field(default=None, repr=False)
    _attempt: creds_mod.Creds | None = field(default=None, repr=False)
    _reconnected: asyncio.Event | None = field(default=None, repr=False)

    @classmethod
    def from_settings(cls, settings: Any) -> "NatsIdentity":
        return cls(
            split_servers(settings.nats_url),
            settings.nats_creds,
            settings.nats_ca_file,
            insecure_dev=settings.nats_insecure_dev,
            creds_check_interval_s=getattr(settings, "nats_creds_check_interval_s", 5.0),
        )

    @property
    def name(self) -> str:
        """The user name in our JWT: it names our inbox prefix, which our permissions allow."""
        if self._name is None:
            if not self.creds_file:
                self._name = "anonymous"
            else:
                try:
                    self._name = creds_mod.read(self.creds_file).name
                except (OSError, JwtError) as exc:
                    raise CredentialError(f"cannot use NATS creds file {self.creds_file}: {exc}") from None
        return self._name

    @property
    def inbox(self) -> bytes:
        return (inbox_prefix(self.name) if self.creds_file else "_INBOX").encode()

    def tls_context(self) -> ssl.SSLContext | None:
        return client_context(self.ca_file) if self.ca_file else None

    def connect_kwargs(self) -> dict[str, Any]:
        """Raises InsecureTransport rather than hand out options that could talk in plaintext."""
        refusal = transport_refusal(self.servers, self.ca_file, self.insecure_dev)
        if refusal is not None:
            raise InsecureTransport(refusal)
        kw: dict[str, Any] = {"servers": self.servers, "inbox_prefix": self.inbox}
        if self.creds_file:
            kw["user_credentials"] = str(Path(self.creds_file))
        if self.ca_file:
            kw.update(client_tls_options(self.ca_file))
        return kw

    # --- refusals -----------------------------------------------------------------------------------

    def describe(self, exc: BaseException) -> str:
        """One line for an error of ours; a TLS failure says so, since it may be a relay stripping TLS."""
        if isinstance(exc, ssl.SSLError):
            return f"TLS handshake failed ({exc.reason or exc}): the server did not speak TLS with our CA"
        if isinstance(exc, TimeoutError) and self.ca_file and not str(exc):
            return "no TLS handshake or no INFO within the connect timeout"
        return str(exc) or type(exc).__name__

    def note_error(self, exc: BaseException) -> None:
        """error_cb: an auth refusal is logged once per distinct reason; the rest at debug level."""
        text = self.describe(exc)
        self.last_error = text
        if is_auth_refusal(text):
            self.last_refusal = text
            if text not in self._warned:
                self._warned.add(text)
                log.warning("nats_auth_refused", reason=text.removeprefix("nats: ").strip("'"), identity=self.name)
        else:
            log.debug("nats_error", error=text)

    def note_connected(self) -> None:
        self._warned.clear()
        self.last_refusal = None
        self.session = self._attempt
        if self._reconnected is not None:
            self._reconnected.set()

    # --- credentials, read at every (re)connect ----------------------------------------------------

    def _sign(self, nonce: str) -> bytes:
        """nats-py's signature_cb, called first for each CONNECT: read the file once for this attempt."""
        assert self.creds_file
        try:
            self._attempt = creds_mod.read(self.creds_file)
        except (OSError, JwtError) as exc:  # nats-py retries its own errors only; the reason holds no secret
            raise nats.errors.Error(f"cannot use NATS creds file {self.creds_file}: {exc}") from None
        kp = nkeys.from_seed(bytearray(self._attempt.seed))
        try:
            return base64.b64encode(kp.sign(nonce.encode()))
        finally:
            kp.wipe()

    def _jwt(self) -> bytes:
        """nats-py's user_jwt_cb, called right after `_sign` for the same CONNECT."""
        assert self._attempt is not None
        return self._attempt.jwt.encode()

    def _auth_kwargs(self, kw: dict[str, Any]) -> dict[str, Any]:
        """The creds file read by our own callbacks instead of nats-py's, so that we know which credentials the
        live session holds (`session`): what a renewal compares the file with."""
        if kw.pop("user_credentials", None) is not None:
            kw.update(signature_cb=self._sign, user_jwt_cb=self._jwt)
        return kw

    async def reconnect_with_file(self, nc: NatsClient, timeout_s: float) -> None:
        """Reconnect `nc` now, which reads the creds file again; returns once the new session is up."""
        self._reconnected = asyncio.Event()
        await nc.force_reconnect()
        await asyncio.wait_for(self._reconnected.wait(), timeout_s)

    async def connect(self, *, name: str, retry_forever: bool = True, **options: Any) -> NatsClient:
        """Connect, retrying a refused or unreachable first connection with back-off when asked to."""

        async def error_cb(exc: Exception) -> None:
            self.note_error(exc)

        async def reconnected_cb() -> None:
            self.note_connected()
            log.info("nats_reconnected", identity=self.name)

        client: list[NatsClient] = []
        caller_closed_cb = options.pop("closed_cb", None)

        async def closed_cb() -> None:
            # nats-py closes for good, without calling error_cb, when the server ends the session with
            # -ERR (revoked or expired user): say why here, once, or the link dies in silence.
            err = client[0].last_error if client else None
            if err is not None:
                self.note_error(err)
            log.info("nats_connection_closed", identity=self.name, error=str(err) if err else None)
            if caller_closed_cb is not None:
                await caller_closed_cb()

        opts = {
            "name": name,
            "error_cb": error_cb,
            "reconnected_cb": reconnected_cb,
            "closed_cb": closed_cb,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            **self._auth_kwargs(self.connect_kwargs()),
            **options,
        }
        # nats-py raises unrelated types for "refused" and "nobody there": every failure is noted (an auth
        # refusal once per reason) and, with retry_forever, tried again with back-off up to 5 s.
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(Exception),
            wait=wait_exponential(multiplier=0.2, max=5.0),
            stop=stop_never if retry_forever else stop_after_attempt(1),
            reraise=True,
            before_sleep=lambda state: log.debug("nats_connect_retry", error=str(state.outcome.exception())),
        )
        async for attempt in retrying:
            with attempt:
                try:
                    nc = await nats.connect(**opts)
                except Exception as exc:
                    self.note_error(exc)
                    raise
        client.append(nc)
        self.note_connected()
        return nc
