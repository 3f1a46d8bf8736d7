"""Request bodies: strict JSON, text Postgres can store, validated by the route's model; answers as JSON."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from ..api_error import ApiError


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def unstorable(value: Any, where: str = "") -> str | None:
    """Where a value holds text Postgres cannot store (NUL, lone surrogates), if anywhere."""
    if isinstance(value, str):
        if "\x00" in value:
            return where or "<root>"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "<root>"
    elif isinstance(value, dict):
        for k, v in value.items():
            bad = unstorable(k, f"{where}.{k}" if where else "<key>") or unstorable(v, f"{where}.{k}".lstrip("."))
            if bad:
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            bad = unstorable(v, f"{where}.{i}".lstrip("."))
            if bad:
                return bad
    return None


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """JSON (strictly: no NaN/Infinity, text Postgres can store) validated by the route's model; an empty
    body is `{}`, so a missing body fails on the model's required fields, not as a parse error."""
    try:
        data = json.loads(raw, parse_constant=reject_constant) if raw.strip() else {}
    except (ValueError, RecursionError):
        raise ApiError(400, "invalid_json", "request body is not JSON") from None
    bad = unstorable(data)
    if bad:
        raise ApiError(
            422,
            "invalid_request",
            "request body holds text that cannot be stored",
            {"errors": [{"loc": bad, "msg": "NUL or invalid unicode"}]},
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": ".".join(map(str, e["loc"])), "msg": e["msg"]} for e in exc.errors()[:20]]
        raise ApiError(422, "invalid_request", "request body does not match the schema", {"errors": errors}) from None


def jsonable(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json")
    return result
