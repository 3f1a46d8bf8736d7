"""After a commissioning run: fetch the slice firmware preflight's result the way MAAS serves it and judge it.

`GET nodes/{system_id}/results/?type=commissioning&include_output=1&filters=<script>` answers the
machine's commissioning result sets; the run is the set whose id is the machine's
`current_commissioning_result_id` (the id that proved the run happened). The preflight's text is the
result's base64 `stdout` (the script's `.out`), or the combined `output` when stdout is empty.
"""

from __future__ import annotations

from typing import Any

from gpuaas_common.contract import messages as m

from ..adapters.maas_client import decode_output
from ..adapters.maas_models import Machine
from ..domain import slice_preflight as pre
from .ports import Row
from .shared import Operations, Site, now


def _current_set(sets: list[dict[str, Any]], current_id: Any) -> dict[str, Any] | None:
    if not sets:
        return None
    for result_set in sets:
        if current_id is not None and result_set.get("id") == current_id:
            return result_set
    return max(sets, key=lambda s: int(s.get("id") or 0))


def preflight_event(
    row: Row, site: str, script: str, sets: list[dict[str, Any]], current_id: Any
) -> m.NodeSlicePreflightReported:
    result_set = _current_set(sets, current_id)
    result = next((r for r in (result_set or {}).get("results") or () if r.get("name") == script), None)
    parsed: pre.Preflight | None = None
    script_status = exit_status = None
    if result is not None and result.get("status_name") not in ("Pending", "Running"):
        text = decode_output(result, "stdout") or decode_output(result, "output") or ""
        parsed = pre.parse(text)
        script_status, exit_status = result.get("status_name"), result.get("exit_status")
    judged = pre.verdict(parsed, script_status=script_status, exit_status=exit_status)
    return m.NodeSlicePreflightReported(
        operation_id=row["operation_id"],
        site=site,
        system_id=row["system_id"],
        node_id=row["node_id"],
        result_set_id=(result_set or {}).get("id"),
        script_name=script,
        script_status=script_status,
        exit_status=exit_status,
        status=judged.status,  # type: ignore[arg-type]
        reasons=[r[:2000] for r in judged.reasons[:512]],
        warnings=[w[:2000] for w in judged.warnings[:512]],
        checks=[
            m.SlicePreflightCheck(
                check=c.check[:128],
                status=c.status,  # type: ignore[arg-type]
                detail=c.detail[:2048],
                remediation=c.remediation[:2048],
            )
            for c in (parsed.checks if parsed else [])[:512]
        ],
        nvme=[
            m.SlicePreflightNvme(
                by_id=d.by_id,
                kernel=d.kernel,
                os_disk=d.os_disk,
                mounted=d.mounted,
                signatures=d.signatures[:64],
                children=[
                    m.SlicePreflightNvmeChild(name=c.name, mountpoint=c.mountpoint, fstype=c.fstype)
                    for c in d.children[:256]
                ],
            )
            for d in (parsed.nvme if parsed else [])[:256]
        ],
        reported_at=now(),
    )


async def fetch(ops: Operations, site: Site, row: Row, machine: Machine) -> m.NodeSlicePreflightReported:
    """Raises MaasError when MAAS cannot answer; the caller looks again on its next poll."""
    script = ops.settings.maas_slice_preflight_script
    sets = await ops.maas(site, lambda: site.client.list_results(row["system_id"], filters=[script]))
    return preflight_event(row, site.name, script, sets, machine.raw.get("current_commissioning_result_id"))
