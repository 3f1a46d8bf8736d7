"""A machine left deployed by a baremetal allocation that failed, and its release through MAAS.

A baremetal allocation fails after its deploy was sent when MAAS reports Failed deployment, when the deployed
host never enrols, or when ops force-release it. The machine may then run the tenant's image with the tenant's
keys — reachable by a tenant no longer billed for it. The allocation stays failed and the scheduler keeps the
node drained for ops, but the machine itself is released through MAAS at once, exactly as a release would
(same command: the gateway revokes the host's bus identity first, then MAAS erases per the site profile; MAAS
takes a release from Deploying, Deployed or Failed deployment, and one of a machine already Releasing or Ready
is a no-op). The gateway answers every operation; the answer is kept on the failed allocation's timeline for
ops, who undrain the node once they have seen it.
"""

from __future__ import annotations

from typing import Any

from gpuaas_common.bus import HandlerContext
from gpuaas_common.contract import messages as m
from gpuaas_common.logging import get_logger

from ..settings import AllocatorSettings
from .commands import start_teardown
from .lifecycle import note

log = get_logger(__name__)

MACHINE_RELEASED_AFTER_FAILURE = "machine_released_after_failure"
MACHINE_RELEASE_AFTER_FAILURE_FAILED = "machine_release_after_failure_failed"
LATE_DEPLOY_RESULT = "late_deploy_result"


def machine_may_be_deployed(row: dict[str, Any]) -> bool:
    """A failed baremetal allocation whose deploy went out and whose machine was not released yet."""
    return (
        row["shape"] == "baremetal"
        and row["operation_id"] is not None
        and row["release_operation_id"] is None
        and row["maas_system_id"] is not None
    )


async def release_failed_machine(settings: AllocatorSettings, ctx: HandlerContext, row: dict[str, Any]) -> None:
    """Call after the allocation failed, in the same unit of work."""
    if not machine_may_be_deployed(row):
        return
    log.warning("failed_machine_release_started", node_id=row["node_id"], system_id=row["maas_system_id"])
    await start_teardown(settings, ctx, row)


async def record_after_failure(
    ctx: HandlerContext, row: dict[str, Any], res: m.MaasDeployResult | m.MaasReleaseResult
) -> None:
    """A MAAS answer about a failed allocation's machine: the release sent above, or a deploy answered late."""
    if isinstance(res, m.MaasReleaseResult):
        code = MACHINE_RELEASED_AFTER_FAILURE if res.status == "released" else MACHINE_RELEASE_AFTER_FAILURE_FAILED
    else:
        code = LATE_DEPLOY_RESULT
    detail = {
        "operation_id": res.operation_id,
        "system_id": res.system_id,
        "status": res.status,
        "maas_status_name": res.maas_status_name,
        "reason_code": res.reason_code,
        "status_message": res.status_message,
    }
    await note(ctx, row, code, detail, answered=True)
    (log.error if code == MACHINE_RELEASE_AFTER_FAILURE_FAILED else log.info)(
        code, operation_id=res.operation_id, system_id=res.system_id, status=res.status
    )
