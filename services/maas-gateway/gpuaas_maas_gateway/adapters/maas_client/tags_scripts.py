"""Tag and script calls: create and list tags, tag machines, store and read commissioning scripts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .transport import MaasTransport


class TagScriptCalls(MaasTransport):
    async def create_tag(
        self, name: str, comment: str | None = None, definition: str | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        return await self._call(
            "POST",
            "tags/",
            operation="create_tag",
            mutation=True,
            timeout=timeout,
            form={"name": name, "comment": comment, "definition": definition},
        )

    async def list_tags(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return await self._call("GET", "tags/", operation="list_tags", timeout=timeout)

    async def update_tag_nodes(
        self, name: str, add: Iterable[str] = (), remove: Iterable[str] = (), *, timeout: float | None = None
    ) -> dict[str, int]:
        return await self._call(
            "POST",
            f"tags/{name}/",
            op="update_nodes",
            operation="update_tag_nodes",
            mutation=True,
            form={"add": list(add), "remove": list(remove)},
            timeout=timeout,
        )

    async def create_script(
        self, name: str, script: str, script_type: str = "commissioning", *, timeout: float | None = None
    ) -> dict[str, Any]:
        return await self._call(
            "POST",
            "scripts/",
            operation="create_script",
            mutation=True,
            timeout=timeout,
            form={"name": name, "script": script, "type": script_type},
        )

    async def read_script(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._call("GET", f"scripts/{name}/", operation="read_script", timeout=timeout)
