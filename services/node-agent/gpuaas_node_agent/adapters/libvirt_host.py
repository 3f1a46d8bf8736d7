"""libvirt on one host: define/start, stop with a hard-stop fallback, undefine with NVRAM.

libvirt-python is blocking; every call runs in a worker thread so the agent's event loop keeps
heartbeating while a domain starts or stops.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any, TypeVar

import libvirt
from pydantic import BaseModel

from gpuaas_common.logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")

# The default handler prints every libvirt error to stderr as well as raising it; we log them ourselves.
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)

# Test driver: "unsupported flags" (8); older drivers: no support (3). The QEMU driver accepts the flag and,
# once NVRAM exists, refuses a plain undefine (55) — so the NVRAM flag must come first.
_UNDEFINE_FALLBACK_CODES = (libvirt.VIR_ERR_INVALID_ARG, libvirt.VIR_ERR_NO_SUPPORT)


class DomainState(StrEnum):
    NOSTATE = "nostate"
    RUNNING = "running"
    BLOCKED = "blocked"
    PAUSED = "paused"
    SHUTDOWN = "shutdown"  # being shut down
    SHUTOFF = "shutoff"
    CRASHED = "crashed"
    PMSUSPENDED = "pmsuspended"
    ABSENT = "absent"  # no domain of that name


_STATES = {
    libvirt.VIR_DOMAIN_NOSTATE: DomainState.NOSTATE,
    libvirt.VIR_DOMAIN_RUNNING: DomainState.RUNNING,
    libvirt.VIR_DOMAIN_BLOCKED: DomainState.BLOCKED,
    libvirt.VIR_DOMAIN_PAUSED: DomainState.PAUSED,
    libvirt.VIR_DOMAIN_SHUTDOWN: DomainState.SHUTDOWN,
    libvirt.VIR_DOMAIN_SHUTOFF: DomainState.SHUTOFF,
    libvirt.VIR_DOMAIN_CRASHED: DomainState.CRASHED,
    libvirt.VIR_DOMAIN_PMSUSPENDED: DomainState.PMSUSPENDED,
}


class ShutdownPath(StrEnum):
    GRACEFUL = "graceful"  # the guest powered off within the timeout
    FORCED = "forced"  # timeout passed, destroy() pulled the plug
    ALREADY_OFF = "already_off"
    ABSENT = "absent"


class DomainSummary(BaseModel):
    name: str
    uuid: str
    state: DomainState
    persistent: bool


class LibvirtHostError(Exception):
    """`code` is libvirt's error code (e.g. 42 no domain, 55 operation invalid), None for our own refusals."""

    def __init__(self, op: str, name: str | None, message: str, code: int | None = None) -> None:
        self.op = op
        self.name = name
        self.code = code
        self.libvirt_message = message
        super().__init__(f"libvirt {op}({name or ''}) failed [code {code}]: {message}")

    @classmethod
    def wrap(cls, op: str, name: str | None, exc: libvirt.libvirtError) -> LibvirtHostError:
        return cls(op, name, exc.get_error_message() or str(exc), exc.get_error_code())


def _code(exc: libvirt.libvirtError) -> int:
    return exc.get_error_code()


class LibvirtHost:
    """One connection per object: `test:///default` state is shared between connections open at the same
    time in one process, so tests keep exactly one host object per simulated host."""

    def __init__(self, uri: str, *, poll_interval_s: float = 0.2) -> None:
        self.uri = uri
        self.poll_interval_s = poll_interval_s
        self._conn: libvirt.virConnect | None = None
        self._open_lock = threading.Lock()

    # --- connection -------------------------------------------------------------------------------

    def _connection(self) -> libvirt.virConnect:
        with self._open_lock:
            if self._conn is None or not self._conn.isAlive():
                try:
                    self._conn = libvirt.open(self.uri)
                except libvirt.libvirtError as exc:
                    raise LibvirtHostError.wrap("open", self.uri, exc) from exc
                log.info("libvirt_connected", uri=self.uri)
            return self._conn

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def close(self) -> None:
        def _close() -> None:
            with self._open_lock:
                if self._conn is not None:
                    try:
                        self._conn.close()
                    finally:
                        self._conn = None

        await self._call(_close)

    async def __aenter__(self) -> LibvirtHost:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _lookup(self, name: str) -> libvirt.virDomain | None:
        try:
            return self._connection().lookupByName(name)
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise LibvirtHostError.wrap("lookup", name, exc) from exc

    # --- queries ----------------------------------------------------------------------------------

    async def exists(self, name: str) -> bool:
        return await self._call(lambda: self._lookup(name) is not None)

    def _state_sync(self, name: str) -> DomainState:
        dom = self._lookup(name)
        if dom is None:
            return DomainState.ABSENT
        try:
            state, _reason = dom.state()
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                return DomainState.ABSENT
            raise LibvirtHostError.wrap("state", name, exc) from exc
        return _STATES.get(state, DomainState.NOSTATE)

    async def state(self, name: str) -> DomainState:
        return await self._call(self._state_sync, name)

    async def xml(self, name: str) -> str | None:
        """The domain's live XML, None when there is no such domain."""

        def _xml() -> str | None:
            dom = self._lookup(name)
            if dom is None:
                return None
            try:
                return str(dom.XMLDesc(0))
            except libvirt.libvirtError as exc:
                if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                    return None
                raise LibvirtHostError.wrap("xml", name, exc) from exc

        return await self._call(_xml)

    async def list_domains(self) -> list[DomainSummary]:
        def _list() -> list[DomainSummary]:
            try:
                domains = self._connection().listAllDomains()
                return [
                    DomainSummary(
                        name=d.name(),
                        uuid=d.UUIDString(),
                        state=_STATES.get(d.state()[0], DomainState.NOSTATE),
                        persistent=bool(d.isPersistent()),
                    )
                    for d in domains
                ]
            except libvirt.libvirtError as exc:
                raise LibvirtHostError.wrap("list", None, exc) from exc

        return await self._call(_list)

    # --- lifecycle --------------------------------------------------------------------------------

    async def define_and_start(self, xml: str) -> str:
        """Define the domain persistently and start it; returns its UUID. A domain that was defined but would
        not start is undefined again, so a retry does not trip over a half-made leftover."""

        def _define() -> libvirt.virDomain:
            try:
                return self._connection().defineXML(xml)
            except libvirt.libvirtError as exc:
                raise LibvirtHostError.wrap("define", None, exc) from exc

        dom = await self._call(_define)
        name, dom_uuid = dom.name(), dom.UUIDString()
        log.info("libvirt_domain_defined", domain=name, uuid=dom_uuid)
        try:
            await self._call(dom.create)
        except libvirt.libvirtError as exc:
            err = LibvirtHostError.wrap("start", name, exc)
            log.error("libvirt_domain_start_failed", domain=name, code=err.code, error=err.libvirt_message)
            try:
                await self.undefine(name)
            except LibvirtHostError as cleanup_exc:
                log.error("libvirt_domain_rollback_failed", domain=name, error=str(cleanup_exc))
            raise err from exc
        log.info("libvirt_domain_started", domain=name, uuid=dom_uuid)
        return dom_uuid

    async def shutdown(self, name: str, timeout_s: float) -> ShutdownPath:
        """Ask the guest to power off (ACPI); if it is still running after `timeout_s`, destroy it."""
        dom = await self._call(self._lookup, name)
        if dom is None:
            return ShutdownPath.ABSENT
        if not await self._is_active(dom, name):
            return ShutdownPath.ALREADY_OFF

        try:
            await self._call(dom.shutdown)
        except libvirt.libvirtError as exc:
            # It may have stopped between the check and the request; anything else still gets the hard stop.
            if not await self._is_active(dom, name):
                return ShutdownPath.GRACEFUL
            log.warning("libvirt_shutdown_request_failed", domain=name, code=_code(exc), error=str(exc))

        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            if not await self._is_active(dom, name):
                log.info("libvirt_domain_stopped", domain=name, path=ShutdownPath.GRACEFUL.value)
                return ShutdownPath.GRACEFUL
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.sleep(min(self.poll_interval_s, remaining))

        try:
            await self._call(dom.destroy)
        except libvirt.libvirtError as exc:
            if not await self._is_active(dom, name):
                return ShutdownPath.GRACEFUL
            raise LibvirtHostError.wrap("destroy", name, exc) from exc
        log.warning("libvirt_domain_stopped", domain=name, path=ShutdownPath.FORCED.value, timeout_s=timeout_s)
        return ShutdownPath.FORCED

    async def _is_active(self, dom: libvirt.virDomain, name: str) -> bool:
        try:
            return bool(await self._call(dom.isActive))
        except libvirt.libvirtError as exc:
            if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                return False
            raise LibvirtHostError.wrap("isActive", name, exc) from exc

    async def undefine(self, name: str) -> bool:
        """Remove the persistent definition and its NVRAM. False when no such domain exists. A running domain
        is refused: undefining it would leave a transient domain still holding the GPUs and the disk."""

        def _undefine() -> bool:
            dom = self._lookup(name)
            if dom is None:
                return False
            try:
                if dom.isActive():
                    raise LibvirtHostError("undefine", name, "domain is running; shut it down before undefine")
                try:
                    dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
                    method = "nvram"
                except libvirt.libvirtError as exc:
                    if _code(exc) not in _UNDEFINE_FALLBACK_CODES:
                        raise
                    log.info("libvirt_undefine_nvram_refused", domain=name, code=_code(exc))
                    dom.undefine()
                    method = "plain"
            except libvirt.libvirtError as exc:
                if _code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                    return False
                raise LibvirtHostError.wrap("undefine", name, exc) from exc
            log.info("libvirt_domain_undefined", domain=name, method=method)
            return True

        return await self._call(_undefine)
