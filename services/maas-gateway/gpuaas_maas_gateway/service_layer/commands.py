"""The bus command handler: it only records the operation, so a redelivered command never calls MAAS twice.

The worker (worker.py) drives every recorded operation; recording is idempotent by operation_id.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuaas_common.contract import derived_event_id
from gpuaas_common.logging import get_logger

from ..settings import GatewaySettings
from .ports import GatewayContext
from .shared import result_event

log = get_logger(__name__)

COMMAND_KINDS = {
    "maas.deploy_requested": "deploy",
    "maas.release_requested": "release",
    "maas.commission_requested": "commission",
    "maas.tags_sync_requested": "sync_tags",
    "maas.image_upload_requested": "upload_image",
    "maas.profile_image_set_requested": "set_distro_series",
}
# Fields with their own column; everything else of a command is kept in `params`.
_COLUMNS = ("operation_id", "allocation_id", "site", "system_id", "node_id", "profile")


class OperationHandlers:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings

    def handlers(self) -> dict[str, Callable[[GatewayContext[Any]], Awaitable[None]]]:
        return {type_: self.on_command for type_ in COMMAND_KINDS}

    async def on_command(self, ctx: GatewayContext[Any]) -> None:
        cmd = ctx.payload
        kind = COMMAND_KINDS[ctx.envelope.type]
        fields = cmd.model_dump(mode="json")
        params = {k: v for k, v in fields.items() if k not in _COLUMNS}
        if kind == "deploy":
            # Where the command lies in the MAAS stream: the credential authority reads it there and mints the
            # host's user only for what it asks (issue 38). Kept with the operation, as the worker mints later.
            params["command_seq"] = ctx.stream_seq
        inserted = await ctx.uow.repos.operations.record(
            operation_id=cmd.operation_id,
            kind=kind,
            allocation_id=getattr(cmd, "allocation_id", None),
            site=cmd.site,
            system_id=getattr(cmd, "system_id", None),
            node_id=getattr(cmd, "node_id", None),
            profile=getattr(cmd, "profile", None),
            params=params,
            deadline_at=datetime.now(UTC) + timedelta(seconds=self._deadline_s(kind)),
        )
        log.info("operation_recorded" if inserted else "operation_already_known", kind=kind, site=cmd.site)
        if not inserted and kind == "deploy" and ctx.stream_seq is not None:
            # The allocator asks an open deploy again while it waits: the newest asking is what later mints name,
            # so the authority's age limit can stay short (a released allocation is asked no more).
            if await ctx.uow.repos.operations.refresh_command_seq(cmd.operation_id, ctx.stream_seq):
                log.info("deploy_command_refreshed", operation_id=cmd.operation_id, command_seq=ctx.stream_seq)
        if not inserted:
            await self._answer_again(ctx, cmd.operation_id)

    def _deadline_s(self, kind: str) -> float:
        if kind == "release":
            return self.settings.maas_release_deadline_s
        return self.settings.maas_deadline_s

    async def _answer_again(self, ctx: GatewayContext[Any], operation_id: str) -> None:
        """A command for an operation that already finished is asked again (the asker lost its commit of the
        result, e.g. a database crash without synchronous commit): send the result again, under an id of this
        asking's own — under the first one JetStream would drop it as a duplicate. Nothing is called again."""
        row = await ctx.uow.repos.operations.get(operation_id)
        if row is None or row["state"] not in ("succeeded", "failed"):
            return  # still open: the worker sends the result when it has one
        stored = row["result"]
        result = json.loads(stored) if isinstance(stored, str) else dict(stored or {})
        type_, payload = result_event(
            row, row["state"], row["last_status"], row["reason_code"], row["status_message"], result
        )
        aggregate = str(row["allocation_id"] or operation_id)
        await ctx.outbox.add(
            type_, payload, aggregate_id=aggregate, event_id=derived_event_id(ctx.envelope.event_id, "result-again")
        )
        log.info("operation_result_sent_again", operation_id=operation_id, outcome=row["state"])
