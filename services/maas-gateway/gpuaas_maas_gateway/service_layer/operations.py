"""MAAS operations: record the command, submit it, observe MAAS until the outcome is known.

The command handlers only record the operation (idempotent by operation_id), so a redelivered
command never calls MAAS twice. A worker drives every open operation. Before each MAAS mutation the
row is committed as `submitting`: a crash during the call leaves evidence, and a restarted worker
treats it as unknown and observes instead of calling again.

Each MAAS site has its own client (and API key), concurrency limit and circuit breaker. While a
site's breaker is open its operations wait where they are; they are neither failed nor submitted.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import asyncpg
from prometheus_client import Counter, Gauge, Histogram

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import bound_context, get_logger
from gpuaas_common.outbox import OutboxWriter

from ..adapters.host_credentials import HostCredentials
from ..adapters.maas_client import MaasClient
from ..adapters.maas_errors import (
    MaasBadRequest,
    MaasConflict,
    MaasError,
    MaasNoResponse,
    MaasNotFound,
    MaasUnreachable,
)
from ..domain.breaker import CircuitBreaker
from ..domain.operations import (
    Decision,
    decide,
    decide_commission,
    image_name,
    normalise_distro_series,
)
from ..settings import GatewaySettings, SiteProfile

log = get_logger(__name__)

OP_DURATION = Histogram("gpuaas_maas_operation_seconds", "Command-to-outcome time", ["kind", "outcome"])
UNKNOWN_OUTCOMES = Counter("gpuaas_maas_unknown_outcomes_total", "Mutations whose outcome was unknown", ["kind"])
UNKNOWN_RESOLUTION = Histogram("gpuaas_maas_unknown_resolution_seconds", "Unknown-to-resolved time", ["kind", "decision"])
MAAS_CALLS = Counter("gpuaas_maas_mutations_total", "Mutating MAAS calls", ["kind"])
RESUBMITS = Counter("gpuaas_maas_resubmits_total", "Submits repeated after MAAS proved it had not taken one",
                    ["kind"])
BREAKER_STATE = Gauge("gpuaas_maas_breaker_state", "Circuit breaker per site: 0 closed, 1 half-open, 2 open",
                      ["site"])
BREAKER_OPENED = Counter("gpuaas_maas_breaker_opened_total", "Times a site's circuit breaker opened", ["site"])

OPEN_STATES = ("pending", "submitting", "unknown", "accepted")
MACHINE_KINDS = ("deploy", "release", "commission")
TAG_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
T = TypeVar("T")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def enrolment_token(secret: str, allocation_id: str, system_id: str) -> str:
    return hmac.new(secret.encode(), f"{allocation_id}:{system_id}".encode(), hashlib.sha256).hexdigest()


NODE_CREDS_PATH = "/etc/gpuaas/node.creds"


def render_user_data(bootstrap: str, token: str, allocation_id: str, node_id: str, system_id: str,
                     creds: str | None = None) -> str:
    """cloud-config that hands the node agent its identity, its one-time enrolment token and, with
    bus identities on, its own short-lived NATS credentials bound to this allocation."""
    env = (
        f"GPUAAS_NODE_ID={node_id}\nGPUAAS_ALLOCATION_ID={allocation_id}\n"
        f"GPUAAS_MAAS_SYSTEM_ID={system_id}\nGPUAAS_ENROLMENT_TOKEN={token}\n"
    )
    if creds:
        env += f"GPUAAS_NATS_CREDS={NODE_CREDS_PATH}\n"
    indented = "".join(f"      {line}\n" for line in env.splitlines())
    doc = (
        "#cloud-config\n"
        "write_files:\n"
        "  - path: /etc/gpuaas/node-agent.env\n"
        "    permissions: '0600'\n"
        "    content: |\n"
        f"{indented}"
    )
    if creds:
        doc += (
            f"  - path: {NODE_CREDS_PATH}\n"
            "    permissions: '0600'\n"
            "    content: |\n"
            + "".join(f"      {line}\n" if line else "\n" for line in creds.splitlines())
        )
    if bootstrap:
        doc += bootstrap if bootstrap.endswith("\n") else bootstrap + "\n"
    return doc


# --- commands -----------------------------------------------------------------------------------------

COMMAND_KINDS = {
    "maas.deploy_requested": "deploy",
    "maas.release_requested": "release",
    "maas.commission_requested": "commission",
    "maas.tags_sync_requested": "sync_tags",
    "maas.image_upload_requested": "upload_image",
    "maas.profile_image_set_requested": "set_distro_series",
}


class OperationHandlers:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings

    def handlers(self) -> dict[str, Callable[[HandlerContext], Awaitable[None]]]:
        return {type_: self.on_command for type_ in COMMAND_KINDS}

    async def on_command(self, ctx: HandlerContext) -> None:
        cmd = ctx.payload
        kind = COMMAND_KINDS[ctx.envelope.type]
        fields = cmd.model_dump(mode="json")
        params = {k: v for k, v in fields.items()
                  if k not in ("operation_id", "allocation_id", "site", "system_id", "node_id", "profile", "erase")}
        inserted = await ctx.conn.fetchval(
            "INSERT INTO maas_operations (operation_id, kind, allocation_id, site, system_id, node_id, profile, "
            "erase, params, state, deadline_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, 'pending', $10) "
            "ON CONFLICT (operation_id) DO NOTHING RETURNING 1",
            cmd.operation_id, kind, getattr(cmd, "allocation_id", None), cmd.site, getattr(cmd, "system_id", None),
            getattr(cmd, "node_id", None), getattr(cmd, "profile", None), getattr(cmd, "erase", None),
            json.dumps(params), _now() + timedelta(seconds=self.settings.maas_deadline_s),
        )
        log.info("operation_recorded" if inserted else "operation_already_known", kind=kind, site=cmd.site)


# --- the worker ---------------------------------------------------------------------------------------


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

    def publish_state(self) -> None:
        BREAKER_STATE.labels(self.name).set(int(self.breaker.state))


class OperationWorker:
    def __init__(
        self,
        settings: GatewaySettings,
        pool: asyncpg.Pool,
        clients: MaasClient | Mapping[str, MaasClient],
        *,
        clock: Callable[[], float] = time.monotonic,
        host_credentials: HostCredentials | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.clock = clock
        self.host_credentials = host_credentials
        if isinstance(clients, MaasClient):
            clients = {settings.maas_default_site: clients}
        configured = settings.sites()
        self.sites: dict[str, Site] = {}
        for name, client in clients.items():
            limit = configured[name].max_concurrency if name in configured else None
            self.sites[name] = Site(
                name, client, asyncio.Semaphore(limit or settings.maas_max_concurrency),
                CircuitBreaker(settings.maas_breaker_failures, settings.maas_breaker_cooldown_s),
            )
            self.sites[name].publish_state()
        self._in_flight: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        # A restart finds calls that were in flight: their outcome is unknown by definition.
        await self.pool.execute(
            "UPDATE maas_operations SET state = 'unknown', unknown_since = COALESCE(unknown_since, now()), "
            "resolution = 'polled', updated_at = now() WHERE state = 'submitting'"
        )
        while True:
            await self.tick()
            await asyncio.sleep(min(0.2, self.settings.maas_poll_interval_s))

    async def tick(self) -> None:
        due = await self.pool.fetch(
            "SELECT operation_id, site FROM maas_operations WHERE state = ANY($1::text[]) "
            "AND next_attempt_at <= now() ORDER BY next_attempt_at LIMIT 500",
            list(OPEN_STATES),
        )
        for row in due:
            op_id = row["operation_id"]
            if op_id not in self._in_flight:
                self._in_flight.add(op_id)
                task = asyncio.ensure_future(self._step_guarded(op_id, row["site"]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _retry_delay(self, exc: MaasError | None = None) -> float:
        """The poll interval, or MAAS's Retry-After when it asked for longer (capped)."""
        delay = self.settings.maas_poll_interval_s
        if exc is not None and exc.retry_after is not None:
            delay = max(delay, min(exc.retry_after, self.settings.maas_retry_after_cap_s))
        return delay

    async def _step_guarded(self, op_id: str, site_name: str) -> None:
        site = self.sites.get(site_name)
        try:
            if site is None:
                await self.step(op_id)
                return
            async with site.semaphore:
                await self.step(op_id)
        except BreakerOpen as exc:
            await self._set(op_id, delay=max(exc.wait_s, self.settings.maas_poll_interval_s),
                            last_error="MAAS unreachable: circuit breaker open")
        except Exception as exc:  # keep the loop alive; the row stays open and is retried
            log.error("operation_step_failed", operation_id=op_id, error=repr(exc))
            delay = self._retry_delay(exc if isinstance(exc, MaasError) else None)
            await self._set(op_id, delay=delay, last_error=repr(exc)[:500])
        finally:
            self._in_flight.discard(op_id)

    async def step(self, op_id: str) -> None:
        row = await self.pool.fetchrow("SELECT * FROM maas_operations WHERE operation_id = $1", op_id)
        if row is None or row["state"] not in OPEN_STATES:
            return
        ctx = {"operation_id": op_id, "site": row["site"], "kind": row["kind"]}
        if row["allocation_id"] is not None:
            ctx["allocation_id"] = str(row["allocation_id"])
        if row["system_id"] is not None:
            ctx["system_id"] = row["system_id"]
        with bound_context(**ctx):
            if row["deadline_at"] <= _now():
                never_sent = row["state"] == "pending" and row["maas_calls"] == 0
                await self._finish(row, "failed", reason_code="maas_unreachable" if never_sent else "unresolved",
                                   message="no outcome observed before the deadline")
                return
            site = self.sites.get(row["site"])
            if site is None:
                await self._finish(row, "failed", reason_code="unknown_site",
                                   message=f"no MAAS site {row['site']!r} is configured")
                return
            now = self.clock()
            if not site.breaker.allow(now):
                raise BreakerOpen(site.breaker.wait_s(now))
            try:
                await self._dispatch(site, row)
            except Unresolvable as exc:
                await self._finish(row, "failed", reason_code=exc.reason_code, message=exc.message)
            finally:
                # A step that made no MAAS call must not keep a half-open breaker's one trial slot.
                site.breaker.released()
                site.publish_state()

    async def _dispatch(self, site: Site, row: asyncpg.Record) -> None:
        kind = row["kind"]
        if kind == "upload_image":
            await self._upload_image(site, row)
        elif kind == "sync_tags":
            await self._sync_tags(site, row)
        elif kind == "set_distro_series":
            await self._set_distro_series(site, row)
        elif row["state"] == "pending":
            await self._submit(site, row)
        else:
            await self._observe(site, row)

    async def _maas(self, site: Site, call: Callable[[], Awaitable[T]]) -> T:
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

    # --- machine operations: deploy, release, commission ---------------------------------------------

    async def _machine_busy(self, row: asyncpg.Record) -> bool:
        """Another operation on this machine whose outcome is not known yet: submitting now could
        double a mutation MAAS may already have taken."""
        return bool(await self.pool.fetchval(
            "SELECT 1 FROM maas_operations WHERE site = $1 AND system_id = $2 AND operation_id <> $3 "
            "AND state IN ('submitting', 'unknown')", row["site"], row["system_id"], row["operation_id"],
        ))

    async def _submit(self, site: Site, row: asyncpg.Record) -> None:
        op_id, kind = row["operation_id"], row["kind"]
        if await self._machine_busy(row):
            log.info("maas_submit_deferred_machine_busy")
            await self._set(op_id, delay=self.settings.maas_poll_interval_s)
            return
        if kind == "deploy":
            call = await self._deploy_call(site, row)
        elif kind == "release":
            # The host's bus identity ends before MAAS takes the machine back: the tenant still has root.
            if not await self._revoke_host_credentials(row):
                await self._set(op_id, delay=self.settings.maas_poll_interval_s)
                return
            call = await self._release_call(site, row)
        else:
            call = await self._commission_call(site, row)
        # Only this conditional update may start a call: a second worker loses the race here.
        started = await self.pool.fetchval(
            "UPDATE maas_operations SET state = 'submitting', maas_calls = maas_calls + 1, updated_at = now() "
            "WHERE operation_id = $1 AND state = 'pending' RETURNING 1", op_id,
        )
        if not started:
            return
        MAAS_CALLS.labels(kind).inc()
        try:
            machine = await self._maas(site, call)
        except MaasUnreachable as exc:
            # Nothing reached MAAS: still pending, and the breaker decides when to try again.
            await self._set(op_id, state="pending", last_error=str(exc)[:500],
                            delay=self.settings.maas_poll_interval_s)
            return
        except MaasError as exc:
            if exc.outcome_unknown:
                UNKNOWN_OUTCOMES.labels(kind).inc()
                log.warning("maas_outcome_unknown", error=str(exc), status=exc.status)
                await self._set(op_id, state="unknown", unknown_since=_now(), resolution="polled",
                                last_error=str(exc)[:500], delay=self._retry_delay(exc))
            elif isinstance(exc, MaasConflict) and exc.retry_after is not None:
                # A serialization conflict was rolled back: send again after the advised wait.
                await self._set(op_id, state="pending", last_error=str(exc)[:500], delay=self._retry_delay(exc))
            elif kind == "deploy" and isinstance(exc, MaasConflict) and await self._deployed_by_us(site, row):
                # An earlier submit of ours did land after all (MAAS answers a repeat with 409).
                log.warning("maas_deploy_conflict_is_ours")
                await self._set(op_id, state="accepted", resolution="polled", last_error=str(exc)[:500],
                                delay=self.settings.maas_poll_interval_s)
            else:
                await self._finish(row, "failed", reason_code=f"maas_http_{exc.status}", message=exc.body[:500])
            return
        log.info("maas_submitted", status=machine.status_name)
        await self._set(op_id, state="accepted", last_status=machine.status_name,
                        delay=self.settings.maas_poll_interval_s)

    async def _deployed_by_us(self, site: Site, row: asyncpg.Record) -> bool:
        mine = await self._maas(site, lambda: site.client.list_machines(
            id=row["system_id"], agent_name=str(row["allocation_id"])))
        return any(mm.status_name in ("Deploying", "Deployed") for mm in mine)

    async def _profile(self, site: str, name: str | None) -> tuple[str, SiteProfile]:
        profile = self.settings.site_profiles.get(name or "")
        if profile is None:
            raise Unresolvable("unknown_profile", f"unknown site profile {name!r}")
        override = await self.pool.fetchval(
            "SELECT distro_series FROM maas_site_profiles WHERE site = $1 AND profile = $2", site, name)
        return (name or ""), (profile.model_copy(update={"distro_series": override}) if override else profile)

    async def _uploaded(self, site: str) -> frozenset[str]:
        rows = await self.pool.fetch("SELECT name FROM maas_boot_resources WHERE site = $1", site)
        return frozenset(self.settings.maas_uploaded_images) | {r["name"] for r in rows}

    async def _revoke_host_credentials(self, row: asyncpg.Record) -> bool:
        if self.host_credentials is None or row["allocation_id"] is None:
            return True
        try:
            await self.host_credentials.revoke_allocation(str(row["allocation_id"]))
            return True
        except Exception as exc:  # the bus is down or refused: the release waits, it does not skip this
            log.warning("host_credentials_revoke_failed", error=str(exc)[:300])
            return False

    async def _deploy_call(self, site: Site, row: asyncpg.Record) -> Callable[[], Awaitable[Any]]:
        _, profile = await self._profile(row["site"], row["profile"])
        token = enrolment_token(self.settings.enrolment_secret.get_secret_value(), str(row["allocation_id"]),
                                row["system_id"])
        creds = None
        if self.host_credentials is not None:
            creds = await self.host_credentials.issue(str(row["allocation_id"]), row["node_id"])
        user_data = render_user_data(profile.bootstrap_user_data, token, str(row["allocation_id"]),
                                     row["node_id"], row["system_id"], creds)
        series = normalise_distro_series(profile.distro_series, await self._uploaded(row["site"]))
        return lambda: site.client.deploy(
            row["system_id"], series, user_data=user_data, hwe_kernel=profile.hwe_kernel,
            agent_name=str(row["allocation_id"]), comment=f"gpuaas allocation {row['allocation_id']}",
        )

    async def _release_call(self, site: Site, row: asyncpg.Record) -> Callable[[], Awaitable[Any]]:
        # The erase policy is the profile's the machine was deployed with.
        deployed_with = await self.pool.fetchval(
            "SELECT profile FROM maas_operations WHERE allocation_id = $1 AND kind = 'deploy' "
            "ORDER BY created_at DESC LIMIT 1", row["allocation_id"])
        profile = self.settings.site_profiles.get(deployed_with or "") or next(
            iter(self.settings.site_profiles.values()), None)
        erase = row["erase"] if row["erase"] is not None else (profile.erase_on_release if profile else True)
        quick = bool(profile and profile.quick_erase)
        return lambda: site.client.release(row["system_id"], erase=erase, quick_erase=erase and quick,
                                           comment=f"gpuaas release {row['allocation_id']}")

    async def _commission_call(self, site: Site, row: asyncpg.Record) -> Callable[[], Awaitable[Any]]:
        params = _params(row)
        for script in params.get("scripts") or ():
            await self._ensure_script(site, script)
        # The result id before asking is what later proves whether this run happened.
        before = await self._maas(site, lambda: site.client.read_machine(row["system_id"]))
        baseline = before.raw.get("current_commissioning_result_id")
        await self.pool.execute(
            "UPDATE maas_operations SET progress = progress || $2::jsonb WHERE operation_id = $1",
            row["operation_id"], json.dumps({"baseline_result_id": baseline}),
        )
        return lambda: site.client.commission(
            row["system_id"], commissioning_scripts=params.get("commissioning_scripts") or None,
            testing_scripts=params.get("testing_scripts") or None,
        )

    async def _ensure_script(self, site: Site, script: dict[str, Any]) -> None:
        try:
            await self._maas(site, lambda: site.client.read_script(script["name"]))
            return
        except MaasNotFound:
            pass
        try:
            await self._maas(site, lambda: site.client.create_script(script["name"], script["script"],
                                                                      script.get("type", "commissioning")))
        except MaasBadRequest as exc:
            # A create whose answer was lost earlier may have made it already.
            if "already exists" not in exc.body:
                raise Unresolvable("maas_http_400", f"script {script['name']}: {exc.body[:400]}") from None

    async def _observe(self, site: Site, row: asyncpg.Record) -> None:
        op_id, kind = row["operation_id"], row["kind"]
        try:
            machine = await self._maas(site, lambda: site.client.read_machine(row["system_id"]))
        except MaasError as exc:
            await self._set(op_id, last_error=str(exc)[:500], delay=self._retry_delay(exc))
            return
        untouched_for = (_now() - row["unknown_since"]).total_seconds() if row["unknown_since"] else None
        if kind == "commission":
            decision = decide_commission(
                row["state"], machine.status_name, machine.raw.get("current_commissioning_result_id"),
                (row["progress"] and _json(row["progress"]).get("baseline_result_id")), untouched_for,
                self.settings.maas_grace_s)
        else:
            decision = decide(kind, row["state"], machine.status_name, untouched_for, self.settings.maas_grace_s)
        if row["state"] == "unknown" and decision is not Decision.WAIT:
            UNKNOWN_RESOLUTION.labels(kind, decision.value).observe(untouched_for or 0.0)
            log.info("unknown_resolved", decision=decision.value, status=machine.status_name)
        if decision is Decision.SUCCEEDED:
            await self._finish(row, "succeeded", status=machine.status_name, message=machine.status_message)
        elif decision is Decision.FAILED:
            await self._finish(row, "failed", status=machine.status_name, reason_code="maas_failed",
                               message=machine.status_message or f"machine is {machine.status_name}")
        elif decision is Decision.RESUBMIT:
            RESUBMITS.labels(kind).inc()
            log.warning("unknown_not_accepted_resubmitting", status=machine.status_name)
            await self.pool.execute(
                "UPDATE maas_operations SET state = 'pending', unknown_since = NULL, resubmits = resubmits + 1, "
                "last_status = $2, next_attempt_at = now(), updated_at = now() "
                "WHERE operation_id = $1 AND state = 'unknown'", op_id, machine.status_name,
            )
        elif decision is Decision.ACCEPTED:
            await self._set(op_id, state="accepted", last_status=machine.status_name,
                            delay=self.settings.maas_poll_interval_s)
        else:
            await self._set(op_id, last_status=machine.status_name, delay=self.settings.maas_poll_interval_s)

    # --- tags ------------------------------------------------------------------------------------------

    async def _sync_tags(self, site: Site, row: asyncpg.Record) -> None:
        """Tag create and update_nodes are idempotent in effect, so an unknown outcome is simply run again."""
        _, profile = await self._profile(row["site"], row["profile"])
        bad = [t for t in profile.tags if not TAG_NAME.match(t)]
        if bad:
            raise Unresolvable("invalid_tag", f"tag names must match {TAG_NAME.pattern}: {bad}")
        params = _params(row)
        await self.pool.execute("UPDATE maas_operations SET maas_calls = maas_calls + 1, state = 'submitting' "
                                "WHERE operation_id = $1", row["operation_id"])
        added = removed = 0
        try:
            existing = {t["name"] for t in await self._maas(site, site.client.list_tags)}
            for tag in profile.tags:
                if tag not in existing:
                    try:
                        await self._maas(site, lambda tag=tag: site.client.create_tag(
                            tag, comment=f"gpuaas site profile {row['profile']}"))
                    except MaasBadRequest as exc:
                        if "already exists" not in exc.body:
                            raise
                if params.get("add_system_ids") or params.get("remove_system_ids"):
                    counts = await self._maas(site, lambda tag=tag: site.client.update_tag_nodes(
                        tag, add=params.get("add_system_ids") or (), remove=params.get("remove_system_ids") or ()))
                    added += int(counts.get("added", 0))
                    removed += int(counts.get("removed", 0))
        except MaasError as exc:
            if exc.outcome_unknown or isinstance(exc, MaasUnreachable) or exc.retry_after is not None:
                if exc.outcome_unknown:
                    UNKNOWN_OUTCOMES.labels("sync_tags").inc()
                await self._set(row["operation_id"], state="unknown", resolution="polled",
                                unknown_since=row["unknown_since"] or _now(), last_error=str(exc)[:500],
                                delay=self._retry_delay(exc))
                return
            await self._finish(row, "failed", reason_code=f"maas_http_{exc.status}", message=exc.body[:500])
            return
        await self._finish(row, "succeeded",
                           result={"tags": list(profile.tags), "added": added, "removed": removed})

    # --- boot resources --------------------------------------------------------------------------------

    async def _upload_image(self, site: Site, row: asyncpg.Record) -> None:
        """Create the boot resource by sha256 and size, then PUT the file in chunks.

        Every step starts from what MAAS shows: a resource with our sha256 that is complete means done
        (even if the answer to the last chunk was lost); an incomplete one is resumed at the byte
        offset its progress reports; none means the create has to be (re)sent, but only once a lost
        create has had its grace period to show up.
        """
        op_id, params = row["operation_id"], _params(row)
        progress = _json(row["progress"])
        name, arch = image_name(params["name"]), params.get("architecture") or "amd64/generic"
        path = params["source_path"]
        if "sha256" not in progress:
            try:
                size, digest = await asyncio.to_thread(_size_and_sha256, path, self.settings.maas_upload_chunk_bytes)
            except OSError as exc:
                raise Unresolvable("source_unreadable", f"cannot read the image: {exc.strerror}") from None
            if (params.get("sha256") and params["sha256"] != digest) or (params.get("size") and params["size"] != size):
                raise Unresolvable("checksum_mismatch", "the image file does not match the given sha256/size")
            progress = {**progress, "sha256": digest, "size": size}
            await self._set(op_id, delay=0, progress=json.dumps(progress))
        digest, size = progress["sha256"], progress["size"]
        try:
            found = await self._find_resource_file(site, name, arch, digest)
            if found is None:
                untouched = (_now() - row["unknown_since"]).total_seconds() if row["unknown_since"] else None
                if row["state"] == "unknown" and (untouched is None or untouched < self.settings.maas_grace_s):
                    await self._set(op_id, delay=self.settings.maas_poll_interval_s)
                    return
                await self._set(op_id, state="submitting", delay=0, maas_calls=row["maas_calls"] + 1)
                MAAS_CALLS.labels("upload_image").inc()
                created = await self._maas(site, lambda: site.client.create_boot_resource(
                    f"custom/{name}", arch, digest, size, title=params.get("title") or "",
                    filetype=params.get("filetype") or "tgz", base_image=params.get("base_image") or None))
                found = _file_in(created, digest)
                if found is None:
                    raise Unresolvable("maas_unexpected", "MAAS created the resource without our file")
            await self._set(op_id, state="accepted", delay=0)
            resource_id, rfile = found
            offset = 0 if rfile.get("complete") else round(float(rfile.get("progress") or 0.0) * size / 100.0)
            chunk_size = self.settings.maas_upload_chunk_bytes
            while not rfile.get("complete") and offset < size:
                chunk = await asyncio.to_thread(_read_at, path, offset, chunk_size)
                if not chunk:
                    raise Unresolvable("source_unreadable", "the image file shrank during the upload")
                MAAS_CALLS.labels("upload_image").inc()
                await self._maas(site, lambda chunk=chunk: site.client.upload_chunk(rfile["upload_uri"], chunk))
                offset += len(chunk)
                await self._set(op_id, delay=0, progress=json.dumps({**progress, "uploaded": offset}))
            found = await self._find_resource_file(site, name, arch, digest)
        except MaasUnreachable as exc:
            await self._set(op_id, state="unknown" if row["maas_calls"] else "pending", last_error=str(exc)[:500],
                            delay=self.settings.maas_poll_interval_s)
            return
        except MaasError as exc:
            if exc.outcome_unknown or exc.retry_after is not None:
                if exc.outcome_unknown:
                    UNKNOWN_OUTCOMES.labels("upload_image").inc()
                await self._set(op_id, state="unknown", resolution="polled",
                                unknown_since=_now(), last_error=str(exc)[:500], delay=self._retry_delay(exc))
                return
            reason = "checksum_mismatch" if "SHA256" in exc.body else f"maas_http_{exc.status}"
            await self._finish(row, "failed", reason_code=reason, message=exc.body[:500])
            return
        if found is None or not found[1].get("complete"):
            # MAAS did not take every byte (e.g. a chunk answer lost in a way we could not see): look again.
            await self._set(op_id, state="unknown", unknown_since=row["unknown_since"] or _now(),
                            resolution="polled", delay=self.settings.maas_poll_interval_s)
            return
        resource_id = found[0]

        async def record(conn: asyncpg.Connection) -> None:
            await conn.execute(
                "INSERT INTO maas_boot_resources (site, name, architecture, boot_resource_id, filetype, sha256, "
                "size, operation_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (site, name, architecture) "
                "DO UPDATE SET boot_resource_id = EXCLUDED.boot_resource_id, filetype = EXCLUDED.filetype, "
                "sha256 = EXCLUDED.sha256, size = EXCLUDED.size, operation_id = EXCLUDED.operation_id, "
                "uploaded_at = now()",
                row["site"], name, arch, resource_id, params.get("filetype") or "tgz", digest, size, op_id,
            )

        log.info("boot_resource_uploaded", boot_resource_id=resource_id, image=name, size=size)
        await self._finish(row, "succeeded", during=record,
                           result={"name": f"custom/{name}", "boot_resource_id": resource_id,
                                   "sha256": digest, "size": size})

    async def _find_resource_file(self, site: Site, name: str, arch: str,
                                  digest: str) -> tuple[int, dict[str, Any]] | None:
        listed = await self._maas(site, site.client.list_boot_resources)
        for item in listed:
            if image_name(item.get("name", "")) == name and item.get("architecture") == arch:
                full = await self._maas(site, lambda item=item: site.client.read_boot_resource(item["id"]))
                found = _file_in(full, digest)
                if found is not None:
                    return found
        return None

    # --- profiles --------------------------------------------------------------------------------------

    async def _set_distro_series(self, site: Site, row: asyncpg.Record) -> None:
        profile_name, profile = await self._profile(row["site"], row["profile"])
        wanted = _params(row)["distro_series"]
        uploaded = await self._uploaded(row["site"])
        osystem, _, series = wanted.rpartition("/")
        stock = (osystem in ("", "ubuntu") and series in self.settings.maas_stock_series)
        if not stock and osystem not in ("", "custom"):
            raise Unresolvable("unknown_distro_series", f"{wanted!r} is neither a stock series nor an upload")
        if not stock and image_name(wanted) not in uploaded:
            # Uploaded outside the gateway is fine too, as long as MAAS has it complete.
            listed = await self._maas(site, site.client.list_boot_resources)
            names = {image_name(r.get("name", "")) for r in listed}
            if image_name(wanted) not in names:
                raise Unresolvable("image_not_uploaded",
                                   f"no boot resource custom/{image_name(wanted)} at site {row['site']}")
            uploaded = uploaded | {image_name(wanted)}
        stored = wanted if stock else image_name(wanted)

        async def store(conn: asyncpg.Connection) -> None:
            await conn.execute(
                "INSERT INTO maas_site_profiles (site, profile, distro_series, operation_id) VALUES ($1, $2, $3, $4) "
                "ON CONFLICT (site, profile) DO UPDATE SET distro_series = EXCLUDED.distro_series, "
                "operation_id = EXCLUDED.operation_id, updated_at = now()",
                row["site"], profile_name, stored, row["operation_id"],
            )

        log.info("profile_distro_series_set", profile=profile_name, previous=profile.distro_series, now=stored)
        await self._finish(row, "succeeded", during=store, result={
            "profile": profile_name, "distro_series": stored, "previous_distro_series": profile.distro_series,
            "deploy_distro_series": normalise_distro_series(stored, uploaded),
        })

    # --- bookkeeping -----------------------------------------------------------------------------------

    async def _set(self, op_id: str, *, delay: float, **fields: Any) -> None:
        sets = ["updated_at = now()", f"next_attempt_at = now() + make_interval(secs => ${len(fields) + 2})"]
        sets += [f"{col} = ${i}" + ("::jsonb" if col == "progress" else "")
                 for i, col in enumerate(fields, start=2)]
        await self.pool.execute(
            f"UPDATE maas_operations SET {', '.join(sets)} WHERE operation_id = $1",
            op_id, *fields.values(), float(delay),
        )

    async def _finish(self, row: asyncpg.Record, outcome: str, *, status: str | None = None,
                      reason_code: str | None = None, message: str | None = None,
                      result: dict[str, Any] | None = None,
                      during: Callable[[asyncpg.Connection], Awaitable[None]] | None = None) -> None:
        kind = row["kind"]
        async with self.pool.acquire() as conn, conn.transaction():
            current = await conn.fetchrow(
                "SELECT * FROM maas_operations WHERE operation_id = $1 FOR UPDATE", row["operation_id"]
            )
            if current is None or current["state"] not in OPEN_STATES:
                return
            if during is not None and outcome == "succeeded":
                await during(conn)
            await conn.execute(
                "UPDATE maas_operations SET state = $2, last_status = COALESCE($3, last_status), "
                "status_message = $4, result = $5::jsonb, updated_at = now() WHERE operation_id = $1",
                row["operation_id"], outcome, status, message, json.dumps(result or {}),
            )
            aggregate = str(row["allocation_id"] or row["operation_id"])
            writer = OutboxWriter(conn, "maas_gateway", "maas-gateway", correlation_id=aggregate)
            type_, payload = _result_event(current, outcome, status, reason_code, message, result or {})
            await writer.add(type_, payload, aggregate_id=aggregate,
                             event_id=derived_event_id(row["operation_id"], "result"))
        OP_DURATION.labels(kind, outcome).observe((_now() - row["created_at"]).total_seconds())
        log.info("operation_finished", outcome=outcome, maas_status=status, reason_code=reason_code)
        if kind == "deploy" and outcome == "failed":
            # A host that never became the tenant's keeps no identity; a failed revoke is retried by
            # the release that follows a failed allocation.
            await self._revoke_host_credentials(row)


def _result_event(row: asyncpg.Record, outcome: str, status: str | None, reason_code: str | None,
                  message: str | None, result: dict[str, Any]) -> tuple[str, m.Payload]:
    kind = row["kind"]
    if kind in ("deploy", "release"):
        common = dict(
            operation_id=row["operation_id"], allocation_id=row["allocation_id"], system_id=row["system_id"],
            node_id=row["node_id"], resolution=row["resolution"], maas_status_name=status,
            status_message=message, reason_code=reason_code, attempts=row["maas_calls"],
        )
        if kind == "deploy":
            return "maas.deploy_result", m.MaasDeployResult(
                status="deployed" if outcome == "succeeded" else "failed", **common)
        return "maas.release_result", m.MaasReleaseResult(
            status="released" if outcome == "succeeded" else "failed", **common)
    common = dict(operation_id=row["operation_id"], site=row["site"], status=outcome,
                  resolution=row["resolution"], reason_code=reason_code, status_message=message,
                  attempts=row["maas_calls"])
    if kind == "commission":
        return "maas.commission_result", m.MaasCommissionResult(
            system_id=row["system_id"], node_id=row["node_id"], maas_status_name=status, **common)
    if kind == "sync_tags":
        return "maas.tags_sync_result", m.MaasTagsSyncResult(profile=row["profile"], **result, **common)
    if kind == "upload_image":
        return "maas.image_upload_result", m.MaasImageUploadResult(
            **{"name": _params(row)["name"], **result}, **common)
    return "maas.profile_image_set_result", m.MaasProfileImageSetResult(
        **{"profile": row["profile"], **result}, **common)


def _json(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)


def _params(row: asyncpg.Record) -> dict[str, Any]:
    return _json(row["params"])


def _file_in(resource: dict[str, Any], digest: str) -> tuple[int, dict[str, Any]] | None:
    """The newest file of a boot resource with this sha256: complete if any is, else the newest."""
    best: dict[str, Any] | None = None
    for version in sorted(resource.get("sets") or {}):
        for rfile in (resource["sets"][version].get("files") or {}).values():
            if rfile.get("sha256") == digest and (best is None or not best.get("complete")):
                best = rfile
    return (int(resource["id"]), best) if best is not None else None


def _size_and_sha256(path: str, chunk: int) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def _read_at(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset, os.SEEK_SET)
        return f.read(length)


def new_operation_id() -> str:
    return str(uuid.uuid4())
