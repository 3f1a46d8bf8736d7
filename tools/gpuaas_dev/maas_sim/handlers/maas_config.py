"""MAAS's global settings (`maas/?op=get_config`, `op=set_config`): the simulator keeps the ones a release reads
(config.ERASE_SETTINGS), so a test can turn a region's "quick erase by default" on and see what a release runs."""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest
from .routing import Call

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _name(call: Call) -> str:
    name = call.params.get("name")
    if not name:
        raise BadRequest("No provided name!")
    if name not in call.state.config.erase_settings:
        raise BadRequest(f"{name} is not a setting this simulator keeps")
    return name


def get_config(call: Call) -> Any:
    return call.state.config.erase_settings[_name(call)]


def set_config(call: Call) -> Any:
    name = _name(call)
    value = (call.params.get("value") or "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise BadRequest(f"value: {value!r} is not a boolean")
    call.state.config.erase_settings[name] = value in _TRUE
    return "OK"
