"""Script operations: list, create, read."""

from __future__ import annotations

from typing import Any

from ..state import API_ROOT
from .routing import Call


def list_scripts(call: Call) -> Any:
    kind = call.params.get("type")
    return [s.to_json(API_ROOT) for s in call.state.scripts.scripts.values() if kind is None or s.script_type == kind]


def create_script(call: Call) -> Any:
    params = call.params
    body = params.files.get("script")
    script = body.decode("utf-8", errors="replace") if body is not None else params.get("script")
    return call.state.scripts.create(
        name=params.get("name") or "",
        script=script,
        script_type=params.get("type"),
        title=params.get("title") or "",
        description=params.get("description") or "",
        tags=tuple(t for v in params.getall("tags") for t in v.split(",") if t),
        timeout=params.get("timeout"),
    ).to_json(API_ROOT)


def read_script(call: Call) -> Any:
    return call.state.scripts.get(call.path["name"]).to_json(API_ROOT)
