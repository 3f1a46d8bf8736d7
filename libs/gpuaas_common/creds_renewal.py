"""A live connection takes up renewed credentials before its own expire, with no gap in its JetStream traffic.

Users live hours to days (services, portal, ops: 24 h; slice hosts: 72 h), and a session whose JWT expires is
ended by the server. Who renews: whoever holds the keys rewrites the creds file once less than half the
lifetime is left (`identity.rotation`: the dev stack's renewer, `gpuaas identities renew` in a deployment);
the process itself never mints. Why a file and not a request to an issuer on the bus: the file is already how
every process gets its identity (compose's volume, the stack's run dir, a host's disk), so renewal needs no
new trust path, no new subject and no key near a service; and it is the same path whoever rewrites it, a
timer, ops by hand, config management.

The process looks at its file every `creds_check_interval_s` (a stat). When it holds other credentials than
the live session's, they are switched to:
1. checked first on a connection of their own: a refused file (expired, revoked, foreign) is logged
   (`nats_creds_renewal_refused`) and the working session kept, so a bad file never costs a working link;
2. the connection's traffic gate is closed (`bus_gate`): publishes awaiting a PubAck and open pull
   requests finish, new ones wait; a flush makes sure the server has every ack we sent;
3. the connection reconnects, reading the file (nats-py replays every subscription; a plain publish made
   meanwhile waits in its buffer), and the gate reopens (`nats_creds_renewed`).
Nothing JetStream owes us is in flight when the old session ends, so no pulled message or PubAck is lost and
none is redelivered. A core request answered during the few milliseconds of the reconnect may have to be
asked again by its requester (they all have timeouts). With less than a quarter of the lifetime left and no
renewed file, `nats_creds_expiring` is logged once: the issuer is not doing its job.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.client import RawCredentials

from .bus_gate import TrafficGate
from .identity import creds as creds_mod
from .identity.jwt import JwtError
from .logging import get_logger
from .natsconn import NatsIdentity, is_auth_refusal

log = get_logger(__name__)

# Left of a session's lifetime when the process warns that no renewed file came.
WARN_FRACTION = 0.25
# The longest a switch may take: the longest exchange in flight (a PubAck, a pull request) plus a reconnect.
SWITCH_TIMEOUT_S = 30.0


def _at(ts: Any) -> str | None:
    return datetime.fromtimestamp(float(ts), UTC).isoformat(timespec="seconds") if ts else None


class CredsRenewal:
    """Watches `identity`'s creds file for the connection `nc` whose JetStream traffic passes `gate`."""

    def __init__(self, identity: NatsIdentity, nc: NatsClient, gate: TrafficGate, *, name: str) -> None:
        self.identity = identity
        self.nc = nc
        self.gate = gate
        self.name = name  # the connection's name, for the probe
        self.renewals = 0
        self._seen: tuple[int, int, int] | None = None  # the file version last judged (ctime, size, inode)
        self._warned_for: str | None = None  # the session JWT an expiry warning was logged for

    async def run(self) -> None:
        while not self.nc.is_closed:
            await self.check()
            await asyncio.sleep(self.identity.creds_check_interval_s)  # a poll of one file, not a wait for state

    async def check(self) -> str:
        """One look: 'renewed', 'unchanged', 'refused' (kept the session), 'later' (look again next time)."""
        path = self.identity.creds_file
        session = self.identity.session
        if not path or session is None:
            return "unchanged"
        try:
            st = _stat(path)
        except OSError:
            return "later"  # being replaced, or gone for a moment: the session stands
        if st == self._seen:
            self._warn_if_expiring(session)
            return "unchanged"
        try:
            fresh = creds_mod.read(path)
        except OSError:
            return "later"  # not ours to read yet (an issuer that sets the owner after writing): look again
        except JwtError as exc:
            log.warning("nats_creds_renewal_refused", identity=self.identity.name, reason=f"not a creds file: {exc}")
            self._seen = st
            return "refused"
        if fresh.jwt == session.jwt:
            self._seen = st
            self._warn_if_expiring(session)
            return "unchanged"
        if not self.nc.is_connected:
            return "later"  # reconnecting already: that reconnect reads the file
        outcome = await self._switch(fresh)
        if outcome != "later":
            self._seen = st
        return outcome

    async def _switch(self, fresh: creds_mod.Creds) -> str:
        refusal = await self._probe(fresh)
        if refusal is not None:
            if refusal.startswith("unreachable"):
                return "later"
            log.warning("nats_creds_renewal_refused", identity=self.identity.name, reason=refusal)
            return "refused"
        started = time.monotonic()
        old = self.identity.session
        try:
            async with self.gate.closed():
                await self.nc.flush(timeout=10)
                await self.identity.reconnect_with_file(self.nc, SWITCH_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as exc:
            # The server went away meanwhile: nats-py reconnects on its own, reading the file.
            log.warning("nats_creds_renewal_failed", identity=self.identity.name, error=self.identity.describe(exc))
            return "later"
        self.renewals += 1
        new = self.identity.session
        log.info(
            "nats_creds_renewed",
            identity=self.identity.name,
            expired_at=_at(old.claims.get("exp")) if old else None,
            expires_at=_at(new.claims.get("exp")) if new else None,
            switch_ms=round((time.monotonic() - started) * 1000, 1),
        )
        return "renewed"

    async def _probe(self, fresh: creds_mod.Creds) -> str | None:
        """None if a server accepts `fresh`; else why not ('unreachable: …' when no server answered)."""
        kw = self.identity.connect_kwargs()
        kw["user_credentials"] = RawCredentials(fresh.render())
        errors: list[str] = []

        async def note(exc: Exception) -> None:
            errors.append(self.identity.describe(exc))

        try:
            probe = await nats.connect(
                **kw,
                name=f"{self.name}-renewal-check",
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=5,
                error_cb=note,
            )
        except Exception as exc:  # noqa: BLE001 - every failure is a reason not to switch
            text = " ".join([*errors, self.identity.describe(exc)])
            return text if is_auth_refusal(text) else f"unreachable: {text}"
        await probe.close()
        return None

    def _warn_if_expiring(self, session: creds_mod.Creds) -> None:
        claims = session.claims
        exp, iat = claims.get("exp"), claims.get("iat")
        if not exp or not iat or self._warned_for == session.jwt:
            return
        if exp - time.time() < (exp - iat) * WARN_FRACTION:
            self._warned_for = session.jwt
            log.warning(
                "nats_creds_expiring",
                identity=self.identity.name,
                expires_at=_at(exp),
                hint="no renewed creds file came: is the issuer (gpuaas identities renew) running?",
            )


def _stat(path: str) -> tuple[int, int, int]:
    st = os.stat(path)  # ctime: a chown or chmod after the write is a change to look at again
    return (st.st_ctime_ns, st.st_size, st.st_ino)
