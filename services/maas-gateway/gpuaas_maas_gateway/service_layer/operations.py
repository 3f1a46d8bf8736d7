"""MAAS operations: record the command, submit it, observe the machine until the outcome is known.

The command handler only records the operation (idempotent by operation_id), so a redelivered
command never calls MAAS twice. A worker drives every open operation. Before each MAAS mutation the
row is committed as `submitting`: a crash during the call leaves evidence, and a restarted worker
treats it as unknown and observes instead of calling again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import asyncpg
from prometheus_client import Counter, Histogram

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import bound_context, get_logger
from gpuaas_common.outbox import OutboxWriter

from ..adapters.maas_client import MaasClient
from ..adapters.maas_errors import MaasConflict, MaasError
from ..domain.operations import Decision, decide, normalise_distro_series
from ..settings import GatewaySettings

log = get_logger(__name__)

OP_DURATION = Histogram("gpuaas_maas_operation_seconds", "Command-to-outcome time", ["kind", "outcome"])
UNKNOWN_OUTCOMES = Counter("gpuaas_maas_unknown_outcomes_total", "Mutations whose outcome was unknown", ["kind"])
UNKNOWN_RESOLUTION = Histogram("gpuaas_maas_unknown_resolution_seconds", "Unknown-to-resolved time", ["kind", "decision"])
MAAS_CALLS = Counter("gpuaas_maas_mutations_total", "Mutating MAAS calls", ["kind"])

OPEN_STATES = ("pending", "submitting", "unknown", "accepted")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def enrolment_token(secret: str, allocation_id: str, system_id: str) -> str:
    return hmac.new(secret.encode(), f"{allocation_id}:{system_id}".encode(), hashlib.sha256).hexdigest()


def render_user_data(bootstrap: str, token: str, allocation_id: str, node_id: str, system_id: str) -> str:
    """cloud-config that hands the node agent its identity and one-time enrolment token."""
    env = (
        f"GPUAAS_NODE_ID={node_id}\nGPUAAS_ALLOCATION_ID={allocation_id}\n"
        f"GPUAAS_MAAS_SYSTEM_ID={system_id}\nGPUAAS_ENROLMENT_TOKEN={token}\n"
    )
    indented = "".join(f"      {line}\n" for line in env.splitlines())
    doc = (
        "#cloud-config\n"
        "write_files:\n"
        "  - path: /etc/gpuaas/node-agent.env\n"
        "    permissions: '0600'\n"
        "    content: |\n"
        f"{indented}"
    )
    if bootstrap:
        doc += bootstrap if bootstrap.endswith("\n") else bootstrap + "\n"
    return doc


class OperationHandlers:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings

    async def on_command(self, ctx: HandlerContext) -> None:
        cmd = ctx.payload
        assert ctx.conn is not None
        kind = "deploy" if ctx.envelope.type == "maas.deploy_requested" else "release"
        inserted = await ctx.conn.fetchval(
            "INSERT INTO maas_operations (operation_id, kind, allocation_id, site, system_id, node_id, profile, "
            "erase, state, deadline_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9) "
            "ON CONFLICT (operation_id) DO NOTHING RETURNING 1",
            cmd.operation_id, kind, cmd.allocation_id, cmd.site, cmd.system_id, cmd.node_id,
            getattr(cmd, "profile", None), getattr(cmd, "erase", None),
            _now() + timedelta(seconds=self.settings.maas_deadline_s),
        )
        log.info("operation_recorded" if inserted else "operation_already_known", kind=kind)


class OperationWorker:
    def __init__(self, settings: GatewaySettings, pool: asyncpg.Pool, client: MaasClient) -> None:
        self.settings = settings
        self.pool = pool
        self.client = client
        self._sem = asyncio.Semaphore(settings.maas_max_concurrency)
        self._in_flight: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        # A restart finds calls that were in flight: their outcome is unknown by definition.
        await self.pool.execute(
            "UPDATE maas_operations SET state = 'unknown', unknown_since = COALESCE(unknown_since, now()), "
            "resolution = 'polled', updated_at = now() WHERE state = 'submitting'"
        )
        while True:
            due = await self.pool.fetch(
                "SELECT operation_id FROM maas_operations WHERE state = ANY($1::text[]) AND next_attempt_at <= now() "
                "ORDER BY next_attempt_at LIMIT 100",
                list(OPEN_STATES),
            )
            for row in due:
                op_id = row["operation_id"]
                if op_id not in self._in_flight:
                    self._in_flight.add(op_id)
                    task = asyncio.ensure_future(self._step_guarded(op_id))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(min(0.2, self.settings.maas_poll_interval_s))

    async def _step_guarded(self, op_id: str) -> None:
        try:
            async with self._sem:
                await self.step(op_id)
        except Exception as exc:  # keep the loop alive; the row stays open and is retried
            log.error("operation_step_failed", operation_id=op_id, error=repr(exc))
            await self.pool.execute(
                "UPDATE maas_operations SET next_attempt_at = now() + make_interval(secs => $2), last_error = $3 "
                "WHERE operation_id = $1", op_id, self.settings.maas_poll_interval_s, repr(exc)[:500],
            )
        finally:
            self._in_flight.discard(op_id)

    async def step(self, op_id: str) -> None:
        row = await self.pool.fetchrow("SELECT * FROM maas_operations WHERE operation_id = $1", op_id)
        if row is None or row["state"] not in OPEN_STATES:
            return
        with bound_context(operation_id=op_id, allocation_id=str(row["allocation_id"]), system_id=row["system_id"]):
            if row["deadline_at"] <= _now():
                await self._finish(row, "failed", reason_code="unresolved",
                                   message="no outcome observed before the deadline")
            elif row["state"] == "pending":
                await self._submit(row)
            else:
                await self._observe(row)

    async def _submit(self, row: asyncpg.Record) -> None:
        op_id, kind = row["operation_id"], row["kind"]
        await self.pool.execute(
            "UPDATE maas_operations SET state = 'submitting', maas_calls = maas_calls + 1, updated_at = now() "
            "WHERE operation_id = $1 AND state = 'pending'", op_id,
        )
        MAAS_CALLS.labels(kind).inc()
        try:
            if kind == "deploy":
                machine = await self._deploy(row)
            else:
                machine = await self._release(row)
        except MaasError as exc:
            if exc.outcome_unknown:
                UNKNOWN_OUTCOMES.labels(kind).inc()
                log.warning("maas_outcome_unknown", kind=kind, error=str(exc))
                await self._set(op_id, state="unknown", unknown_since=_now(), resolution="polled",
                                last_error=str(exc)[:500], delay=self.settings.maas_poll_interval_s)
            elif isinstance(exc, MaasConflict) and exc.retry_after is not None:
                # A serialization conflict was not committed: send again after the advised wait.
                await self._set(op_id, state="pending", last_error=str(exc)[:500], delay=exc.retry_after)
            else:
                await self._finish(row, "failed", reason_code=f"maas_http_{exc.status}", message=exc.body[:500])
            return
        log.info("maas_submitted", kind=kind, status=machine.status_name)
        await self._set(op_id, state="accepted", last_status=machine.status_name,
                        delay=self.settings.maas_poll_interval_s)

    async def _deploy(self, row: asyncpg.Record) -> Any:
        profile = self.settings.site_profiles.get(row["profile"] or "", None)
        if profile is None:
            raise MaasError(None, f"unknown site profile {row['profile']!r}", operation="deploy")
        token = enrolment_token(self.settings.enrolment_secret.get_secret_value(), str(row["allocation_id"]),
                                row["system_id"])
        user_data = render_user_data(profile.bootstrap_user_data, token, str(row["allocation_id"]),
                                     row["node_id"], row["system_id"])
        return await self.client.deploy(
            row["system_id"],
            normalise_distro_series(profile.distro_series, frozenset(self.settings.maas_uploaded_images)),
            user_data=user_data, hwe_kernel=profile.hwe_kernel, agent_name=str(row["allocation_id"]),
            comment=f"gpuaas allocation {row['allocation_id']}",
        )

    async def _release(self, row: asyncpg.Record) -> Any:
        profile = next(iter(self.settings.site_profiles.values()), None)
        erase = row["erase"] if row["erase"] is not None else (profile.erase_on_release if profile else True)
        quick = bool(profile and profile.quick_erase)
        return await self.client.release(row["system_id"], erase=erase, quick_erase=erase and quick,
                                         comment=f"gpuaas release {row['allocation_id']}")

    async def _observe(self, row: asyncpg.Record) -> None:
        op_id = row["operation_id"]
        try:
            machine = await self.client.read_machine(row["system_id"])
        except MaasError as exc:
            await self._set(op_id, last_error=str(exc)[:500],
                            delay=exc.retry_after or self.settings.maas_poll_interval_s)
            return
        untouched_for = (_now() - row["unknown_since"]).total_seconds() if row["unknown_since"] else None
        decision = decide(row["kind"], row["state"], machine.status_name, untouched_for, self.settings.maas_grace_s)
        if row["state"] == "unknown" and decision is not Decision.WAIT:
            UNKNOWN_RESOLUTION.labels(row["kind"], decision.value).observe(untouched_for or 0.0)
            log.info("unknown_resolved", decision=decision.value, status=machine.status_name)
        if decision is Decision.SUCCEEDED:
            await self._finish(row, "succeeded", status=machine.status_name, message=machine.status_message)
        elif decision is Decision.FAILED:
            await self._finish(row, "failed", status=machine.status_name, reason_code="maas_failed",
                               message=machine.status_message or f"machine is {machine.status_name}")
        elif decision is Decision.RESUBMIT:
            log.warning("unknown_not_accepted_resubmitting", status=machine.status_name)
            await self._set(op_id, state="pending", unknown_since=None, last_status=machine.status_name, delay=0)
        elif decision is Decision.ACCEPTED:
            await self._set(op_id, state="accepted", last_status=machine.status_name,
                            delay=self.settings.maas_poll_interval_s)
        else:
            await self._set(op_id, last_status=machine.status_name, delay=self.settings.maas_poll_interval_s)

    async def _set(self, op_id: str, *, delay: float, **fields: Any) -> None:
        sets = ["updated_at = now()", f"next_attempt_at = now() + make_interval(secs => ${len(fields) + 2})"]
        sets += [f"{col} = ${i}" for i, col in enumerate(fields, start=2)]
        await self.pool.execute(
            f"UPDATE maas_operations SET {', '.join(sets)} WHERE operation_id = $1",
            op_id, *fields.values(), float(delay),
        )

    async def _finish(self, row: asyncpg.Record, outcome: str, *, status: str | None = None,
                      reason_code: str | None = None, message: str | None = None) -> None:
        kind = row["kind"]
        async with self.pool.acquire() as conn, conn.transaction():
            current = await conn.fetchrow(
                "SELECT * FROM maas_operations WHERE operation_id = $1 FOR UPDATE", row["operation_id"]
            )
            if current is None or current["state"] not in OPEN_STATES:
                return
            await conn.execute(
                "UPDATE maas_operations SET state = $2, last_status = COALESCE($3, last_status), "
                "status_message = $4, updated_at = now() WHERE operation_id = $1",
                row["operation_id"], outcome, status, message,
            )
            writer = OutboxWriter(conn, "maas_gateway", "maas-gateway", correlation_id=str(row["allocation_id"]))
            common = dict(
                operation_id=row["operation_id"], allocation_id=row["allocation_id"], system_id=row["system_id"],
                node_id=row["node_id"], resolution=current["resolution"], maas_status_name=status,
                status_message=message, reason_code=reason_code, attempts=current["maas_calls"],
            )
            if kind == "deploy":
                payload: Any = m.MaasDeployResult(status="deployed" if outcome == "succeeded" else "failed", **common)
            else:
                payload = m.MaasReleaseResult(status="released" if outcome == "succeeded" else "failed", **common)
            await writer.add(f"maas.{kind}_result", payload, aggregate_id=str(row["allocation_id"]),
                             event_id=derived_event_id(row["operation_id"], "result"))
        OP_DURATION.labels(kind, outcome).observe((_now() - row["created_at"]).total_seconds())
        log.info("operation_finished", kind=kind, outcome=outcome, maas_status=status, reason_code=reason_code)


def new_operation_id() -> str:
    return str(uuid.uuid4())
