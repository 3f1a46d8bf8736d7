"""What every operation kind uses: sites with their breakers, MAAS calls, state writes and the finish.

Each kind module (deploy, release, commission, sync_tags, upload_image, set_distro_series) is a set of
functions over an `Operations`; the poll loop in worker.py is an `Operations` that drives them.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..adapters.host_credentials import HostCredentials
from ..adapters.maas_client import MaasClient
from ..adapters.maas_errors import MaasError, MaasNoResponse, MaasUnreachable
from ..adapters.repository import OPEN_STATES, LeaseLost
from ..domain.breaker import CircuitBreaker
from ..settings import GatewaySettings, SiteProfile
from .metrics import BREAKER_OPENED, BREAKER_STATE, OP_DURATION
from .ports import GatewayDatabase, GatewayRepositories, Row

log = get_logger(__name__)

T = TypeVar("T")


def now() -> datetime:
    return datetime.now(UTC)


class BreakerOpen(Exception):
    def __init__(self, wait_s: float) -> None:
        super().__init__(f"circuit breaker open for {wait_s:.1f}s")
        self.wait_s = wait_s


class Unresolvable(Exception):
    """An operation that can never succeed as asked (bad input, unknown site or profile)."""

    def __init__(self, reason_code: str, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code
        self.message = message


@dataclass
class Site:
    name: str
    client: MaasClient
    semaphore: asyncio.Semaphore
    breaker: CircuitBreaker
    limit: int = 1

    def publish_state(self) -> None:
        BREAKER_STATE.labels(self.name).set(int(self.breaker.state))


def lease_seconds(settings: GatewaySettings) -> float:
    """How long an operation's lease lasts unless renewed: longer than any one MAAS call may take (every
    call is bounded by maas_timeout_s), so a call the holder started has timed out before anybody else
    may take the operation over and look at the machine."""
    return max(2.0 * settings.maas_timeout_s, 1.0)


class Operations:
    """`db`: the operations' state (adapters/repository.py's `PostgresGateway` on the service's pool)."""

    def __init__(
        self,
        settings: GatewaySettings,
        db: GatewayDatabase,
        clients: MaasClient | Mapping[str, MaasClient],
        *,
        clock: Callable[[], float] = time.monotonic,
        host_credentials: HostCredentials | None = None,
    ) -> None:
        self.settings = settings
        # This worker's name on the leases it takes: one per worker object, so a restarted process (or a
        # second worker in one) never mistakes a lease of its predecessor for its own.
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_seconds(settings)
        # Every write of a step is fenced on this worker's lease of the operation.
        self.unit_of_work = db.units_of_work(lease_owner=self.owner, lease_s=self.lease_s)
        # Reads outside a transaction: they only choose what to try; every write re-checks in Postgres.
        # The worker's lease statements (claim, renew, release) go this way too: one statement each.
        self.read = db.reads
        self.clock = clock
        self.host_credentials = host_credentials
        if isinstance(clients, MaasClient):
            clients = {settings.maas_default_site: clients}
        configured = settings.sites()
        self.sites: dict[str, Site] = {}
        for name, client in clients.items():
            limit = configured[name].max_concurrency if name in configured else None
            limit = limit or settings.maas_max_concurrency
            self.sites[name] = Site(
                name,
                client,
                asyncio.Semaphore(limit),
                CircuitBreaker(settings.maas_breaker_failures, settings.maas_breaker_cooldown_s),
                limit,
            )
            self.sites[name].publish_state()

    # --- MAAS ------------------------------------------------------------------------------------------

    async def maas(self, site: Site, call: Callable[[], Awaitable[T]]) -> T:
        """Every MAAS call goes through here so the site's breaker sees how it went."""
        try:
            result = await call()
        except MaasUnreachable:
            if site.breaker.failed(self.clock()):
                BREAKER_OPENED.labels(site.name).inc()
                log.warning("maas_breaker_open", site=site.name, cooldown_s=site.breaker.cooldown_s)
            site.publish_state()
            raise
        except MaasNoResponse:
            site.breaker.released()
            raise
        except MaasError:
            site.breaker.succeeded()  # MAAS answered, so it is up
            site.publish_state()
            raise
        site.breaker.succeeded()
        site.publish_state()
        return result

    def retry_delay(self, exc: MaasError | None = None) -> float:
        """The poll interval, or MAAS's Retry-After when it asked for longer (capped)."""
        delay = self.settings.maas_poll_interval_s
        if exc is not None and exc.retry_after is not None:
            delay = max(delay, min(exc.retry_after, self.settings.maas_retry_after_cap_s))
        return delay

    # --- configuration as changed at run time ----------------------------------------------------------

    async def profile(self, site: str, name: str | None) -> tuple[str, SiteProfile]:
        profile = self.settings.site_profiles.get(name or "")
        if profile is None:
            raise Unresolvable("unknown_profile", f"unknown site profile {name!r}")
        override = await self.read.catalog.distro_series_override(site, name)
        return (name or ""), (profile.model_copy(update={"distro_series": override}) if override else profile)

    async def uploaded(self, site: str) -> frozenset[str]:
        return frozenset(self.settings.maas_uploaded_images) | await self.read.catalog.uploaded_images(site)

    async def end_slice_identity(self, row: Row) -> bool:
        """False while the host's slice-host users could not be revoked: the deploy waits, it does not skip this."""
        if self.host_credentials is None:
            return True
        try:
            await self.host_credentials.end_slice_identity(row["node_id"], str(row["allocation_id"]))
            return True
        except Exception as exc:  # noqa: BLE001 - the bus is down or refused: retried at the next poll
            log.warning("slice_host_revoke_failed", node_id=row["node_id"], error=str(exc)[:300])
            return False

    async def revoke_host_credentials(self, row: Row) -> bool:
        if self.host_credentials is None or row["allocation_id"] is None:
            return True
        try:
            await self.host_credentials.revoke_allocation(str(row["allocation_id"]))
            return True
        except Exception as exc:  # noqa: BLE001 - the bus is down or refused: the release waits, it does not skip this
            log.warning("host_credentials_revoke_failed", error=str(exc)[:300])
            return False

    # --- state -----------------------------------------------------------------------------------------

    async def write(self, change: Callable[[GatewayRepositories], Awaitable[T]]) -> T:
        """One state change in its own unit of work."""
        async with self.unit_of_work() as uow:
            result = await change(uow.repos)
            await uow.commit()
        return result

    async def set(self, op_id: str, *, delay: float, **fields: Any) -> None:
        await self.write(lambda repos: repos.operations.update(op_id, delay=delay, **fields))

    async def finish(
        self,
        row: Row,
        outcome: str,
        *,
        status: str | None = None,
        reason_code: str | None = None,
        message: str | None = None,
        result: dict[str, Any] | None = None,
        during: Callable[[GatewayRepositories], Awaitable[None]] | None = None,
        extra_events: tuple[tuple[str, m.Payload, str], ...] = (),
    ) -> None:
        """Final state, the kind's own rows (`during`, on success) and the result event: one unit of work."""
        kind = row["kind"]
        aggregate = str(row["allocation_id"] or row["operation_id"])
        async with self.unit_of_work(correlation_id=aggregate) as uow:
            current = await uow.repos.operations.lock(row["operation_id"])
            if current is None or current["state"] not in OPEN_STATES:
                return
            if current["lease_owner"] != uow.repos.operations.lease_owner:
                raise LeaseLost(row["operation_id"])
            if during is not None and outcome == "succeeded":
                await during(uow.repos)
            await uow.repos.operations.finish(
                row["operation_id"],
                outcome,
                status=status,
                message=message,
                result=result or {},
                reason_code=reason_code,
            )
            type_, payload = result_event(current, outcome, status, reason_code, message, result or {})
            await uow.events.add(
                type_, payload, aggregate_id=aggregate, event_id=derived_event_id(row["operation_id"], "result")
            )
            for extra_type, extra_payload, suffix in extra_events:
                await uow.events.add(
                    extra_type,
                    extra_payload,
                    aggregate_id=aggregate,
                    event_id=derived_event_id(row["operation_id"], suffix),
                )
            await uow.commit()
        OP_DURATION.labels(kind, outcome).observe((now() - row["created_at"]).total_seconds())
        log.info("operation_finished", outcome=outcome, maas_status=status, reason_code=reason_code)
        if kind == "deploy" and outcome == "failed":
            # A host that never became the tenant's keeps no identity; a failed revoke is retried by
            # the release that follows a failed allocation.
            await self.revoke_host_credentials(row)


def result_event(
    row: Row,
    outcome: str,
    status: str | None,
    reason_code: str | None,
    message: str | None,
    result: dict[str, Any],
) -> tuple[str, m.Payload]:
    kind = row["kind"]
    if kind in ("deploy", "release"):
        common: dict[str, Any] = {
            "operation_id": row["operation_id"],
            "allocation_id": row["allocation_id"],
            "system_id": row["system_id"],
            "node_id": row["node_id"],
            "resolution": row["resolution"],
            "maas_status_name": status,
            "status_message": message,
            "reason_code": reason_code,
            "attempts": row["maas_calls"],
        }
        if kind == "deploy":
            login = {k: result[k] for k in ("ip_addresses", "login_user") if result.get(k) is not None}
            return "maas.deploy_result", m.MaasDeployResult(
                status="deployed" if outcome == "succeeded" else "failed", **common, **login
            )
        # The erase asked is the command's whatever the end (a deadline too); its outcome only once MAAS showed one.
        erase: dict[str, Any] = {"erase_mode": result.get("erase_mode") or release_erase_mode(row)}
        if result.get("erase_outcome") is not None:
            erase["erase_outcome"] = result["erase_outcome"]
        return "maas.release_result", m.MaasReleaseResult(
            status="released" if outcome == "succeeded" else "failed", **common, **erase
        )
    common = {
        "operation_id": row["operation_id"],
        "site": row["site"],
        "status": outcome,
        "resolution": row["resolution"],
        "reason_code": reason_code,
        "status_message": message,
        "attempts": row["maas_calls"],
    }
    if kind == "commission":
        return "maas.commission_result", m.MaasCommissionResult(
            system_id=row["system_id"], node_id=row["node_id"], maas_status_name=status, **common
        )
    if kind == "sync_tags":
        return "maas.tags_sync_result", m.MaasTagsSyncResult(profile=row["profile"], **result, **common)
    if kind == "upload_image":
        return "maas.image_upload_result", m.MaasImageUploadResult(**{"name": params(row)["name"], **result}, **common)
    return "maas.profile_image_set_result", m.MaasProfileImageSetResult(
        **{"profile": row["profile"], **result}, **common
    )


def as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)


def params(row: Row) -> dict[str, Any]:
    return as_dict(row["params"])


# An older allocator's release names no erase: the full overwrite, which destroys the data on every drive.
DEFAULT_ERASE_MODE = "full"


def release_erase_mode(row: Row) -> str:
    """The erase a release command asked for (kept in its params)."""
    return str(params(row).get("erase_mode") or DEFAULT_ERASE_MODE)
