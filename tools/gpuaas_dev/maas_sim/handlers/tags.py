"""Tag operations: list, create, read, the machines carrying a tag, and adding or removing nodes."""

from __future__ import annotations

import re
from typing import Any

from ..errors import BadRequest, NotFound
from ..state import API_ROOT
from .routing import Call

TAG_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")


def _tag(call: Call) -> dict[str, Any]:
    tag = call.state.tags.get(call.path["name"])
    if tag is None:
        raise NotFound("No Tag matches the given query.")
    return tag


def list_tags(call: Call) -> Any:
    return list(call.state.tags.values())


def create_tag(call: Call) -> Any:
    params = call.params
    name = params.get("name") or ""
    if not name:
        raise BadRequest({"name": ["This field is required."]})
    if not TAG_NAME.match(name):
        raise BadRequest({"name": ["Invalid character in the tag name."]})
    if name in call.state.tags:
        raise BadRequest({"name": ["Tag with this Name already exists."]})
    return call.state.ensure_tag(
        name,
        definition=params.get("definition") or "",
        comment=params.get("comment") or "",
        kernel_opts=params.get("kernel_opts") or "",
    )


def read_tag(call: Call) -> Any:
    return _tag(call)


def tag_machines(call: Call) -> Any:
    name = _tag(call)["name"]
    call.state.advance()
    return [m.to_json(API_ROOT) for m in call.state.machines.values() if name in m.tags]


def update_tag_nodes(call: Call) -> Any:
    name = _tag(call)["name"]
    added = removed = 0
    for system_id in call.params.getall("add"):
        machine = call.state.machines.get(system_id)
        if machine is not None and name not in machine.tags:
            machine.tags.add(name)
            added += 1
    for system_id in call.params.getall("remove"):
        machine = call.state.machines.get(system_id)
        if machine is not None and name in machine.tags:
            machine.tags.discard(name)
            removed += 1
    return {"added": added, "removed": removed}
