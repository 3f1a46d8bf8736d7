"""The bus command handler: it only records the operation, so a redelivered command never calls MAAS twice.

The worker (worker.py) drives every recorded operation; recording is idempotent by operation_id.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from gpuaas_common.bus import HandlerContext
from gpuaas_common.logging import get_logger

from ..settings import GatewaySettings

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
_COLUMNS = ("operation_id", "allocation_id", "site", "system_id", "node_id", "profile", "erase")


class OperationHandlers:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings

    def handlers(self) -> dict[str, Callable[[HandlerContext], Awaitable[None]]]:
        return {type_: self.on_command for type_ in COMMAND_KINDS}

    async def on_command(self, ctx: HandlerContext) -> None:
        cmd = ctx.payload
        kind = COMMAND_KINDS[ctx.envelope.type]
        fields = cmd.model_dump(mode="json")
        inserted = await ctx.uow.repos.operations.record(
            operation_id=cmd.operation_id,
            kind=kind,
            allocation_id=getattr(cmd, "allocation_id", None),
            site=cmd.site,
            system_id=getattr(cmd, "system_id", None),
            node_id=getattr(cmd, "node_id", None),
            profile=getattr(cmd, "profile", None),
            erase=getattr(cmd, "erase", None),
            params={k: v for k, v in fields.items() if k not in _COLUMNS},
            deadline_at=datetime.now(UTC) + timedelta(seconds=self.settings.maas_deadline_s),
        )
        log.info("operation_recorded" if inserted else "operation_already_known", kind=kind, site=cmd.site)
