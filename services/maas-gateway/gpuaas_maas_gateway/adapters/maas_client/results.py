"""Script result calls: the result sets of a node's commissioning/testing runs, with their base64 output.

`GET nodes/{system_id}/results/` (MAAS >= 2.2): a list of result sets, one per run, each with its
`results[]` sorted by name; `include_output` (any value switches it on) adds `output`, `stdout`,
`stderr` and `result`, each base64. `GET nodes/{system_id}/results/{id}/` reads one set, where id is a
number or `current-commissioning` / `current-testing` / `current-installation`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any

from .transport import MaasTransport


def decode_output(result: dict[str, Any], key: str = "stdout") -> str | None:
    """The text of one base64 output field of a result (None when absent or not base64)."""
    value = result.get(key)
    if not isinstance(value, str):
        return None
    try:
        return base64.b64decode(value, validate=False).decode("utf-8", errors="replace")
    except (binascii.Error, ValueError):
        return None


class ScriptResultCalls(MaasTransport):
    async def list_results(
        self,
        system_id: str,
        *,
        result_type: str | None = "commissioning",
        include_output: bool = True,
        filters: Iterable[str] = (),
        hardware_type: str | None = None,
        timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        query: dict[str, Any] = {
            "type": result_type,
            "hardware_type": hardware_type,
            "filters": ",".join(filters) or None,
        }
        if include_output:
            query["include_output"] = "1"
        return await self._call(
            "GET",
            f"nodes/{system_id}/results/",
            operation="list_results",
            query={k: v for k, v in query.items() if v is not None},
            system_id=system_id,
            timeout=timeout,
        )

    async def read_result(
        self,
        system_id: str,
        result_id: int | str = "current-commissioning",
        *,
        include_output: bool = True,
        filters: Iterable[str] = (),
        timeout: float | None = None,
    ) -> dict[str, Any]:
        query: dict[str, Any] = {"filters": ",".join(filters) or None}
        if include_output:
            query["include_output"] = "1"
        return await self._call(
            "GET",
            f"nodes/{system_id}/results/{result_id}/",
            operation="read_result",
            query={k: v for k, v in query.items() if v is not None},
            system_id=system_id,
            timeout=timeout,
        )
