"""Boot resource operations: list, create, read, delete, and chunked file upload."""

from __future__ import annotations

from typing import Any

from ..state import API_ROOT
from .routing import Call, Created, NoContent


def list_boot_resources(call: Call) -> Any:
    wanted = call.params.get("type")
    resources = call.state.boot_resources.resources.values()
    if wanted not in (None, "", "uploaded"):
        resources = []  # only uploaded resources are simulated; synced ones are never present
    return [r.to_json(API_ROOT, with_sets=False) for r in resources]


def create_boot_resource(call: Call) -> Any:
    params = call.params
    content = params.files.get("content")
    if content is None and "content" in params:
        content = (params.get("content") or "").encode("utf-8")
    resource = call.state.boot_resources.create(
        name=params.get("name") or "",
        architecture=params.get("architecture") or "",
        title=params.get("title") or "",
        filetype=(params.get("filetype") or "tgz").lower(),
        base_image=params.get("base_image") or "",
        content=content,
        sha256=params.get("sha256"),
        size=params.get("size"),
    )
    return Created(resource.to_json(API_ROOT, with_sets=True))


def read_boot_resource(call: Call) -> Any:
    return call.state.boot_resources.get(call.path["id"]).to_json(API_ROOT, with_sets=True)


def delete_boot_resource(call: Call) -> Any:
    call.state.boot_resources.delete(call.path["id"])
    return NoContent()


def upload_boot_resource_file(call: Call) -> Any:
    call.state.boot_resources.upload(call.path["id"], call.path["file_id"], call.params.body)
    return "OK"
