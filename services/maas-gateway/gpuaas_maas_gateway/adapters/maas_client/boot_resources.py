"""Boot resource calls: list, read and create uploaded images, and PUT their file chunks."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from .transport import MaasTransport


class BootResourceCalls(MaasTransport):
    async def list_boot_resources(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return await self._call(
            "GET", "boot-resources/", operation="list_boot_resources", query={"type": "uploaded"}, timeout=timeout
        )

    async def read_boot_resource(self, resource_id: int, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._call(
            "GET", f"boot-resources/{resource_id}/", operation="read_boot_resource", timeout=timeout
        )

    async def create_boot_resource(
        self,
        name: str,
        architecture: str,
        sha256: str,
        size: int,
        *,
        title: str = "",
        filetype: str = "tgz",
        base_image: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Announce a file by sha256 and size; its bytes follow through `upload_chunk`."""
        form = {
            "name": name,
            "architecture": architecture,
            "sha256": sha256,
            "size": size,
            "title": title or None,
            "filetype": filetype,
            "base_image": base_image,
        }
        return await self._call(
            "POST", "boot-resources/", operation="create_boot_resource", mutation=True, form=form, timeout=timeout
        )

    async def upload_chunk(self, upload_uri: str, chunk: bytes, *, timeout: float | None = None) -> None:
        """PUT one chunk to a file's `upload_uri` (an absolute path, as MAAS reports it)."""
        root_path = urlparse(self._root).path
        if not upload_uri.startswith(root_path):
            raise ValueError(f"upload_uri {upload_uri!r} is not under the API root")
        await self._call(
            "PUT",
            upload_uri[len(root_path) :],
            operation="upload_chunk",
            mutation=True,
            raw_body=chunk,
            timeout=timeout,
        )
