"""The OpenAPI document rendered from the same routes and models, so it cannot drift from the code."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .errors import STATUS_TEXT, Error
from .headers import KEY_RE, PERSON_HEADER
from .routes import Route


def openapi(routes: Sequence[Route], *, title: str, version: str, description: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of these routes, from their pydantic models (JSON Schema 2020-12)."""
    models: list[tuple[type[BaseModel], str]] = [(Error, "serialization")]
    for r in routes:
        if r.body is not None:
            models.append((r.body, "validation"))
        models.append((r.response, "serialization"))
    keys, defs = models_json_schema(list(dict.fromkeys(models)), ref_template="#/components/schemas/{model}")
    error_ref = keys[(Error, "serialization")]
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        parameters: list[dict[str, Any]] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for p in r.path_params
        ]
        parameters += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}} for q in r.query]
        if r.mutation:
            parameters += [
                {"$ref": "#/components/parameters/IdempotencyKey"},
                {"$ref": "#/components/parameters/Person"},
            ]
        parameters.append({"$ref": "#/components/parameters/XRequestId"})
        ok_ref = keys[(r.response, "serialization")]
        responses: dict[str, Any] = {
            str(s): {
                "description": "accepted" if s == 202 else "OK",
                "content": {"application/json": {"schema": ok_ref}},
            }
            for s in r.statuses
        }
        for s in r.documented_errors():
            responses[str(s)] = {"description": STATUS_TEXT[s], "content": {"application/json": {"schema": error_ref}}}
        op: dict[str, Any] = {
            "operationId": f"{r.method.lower()}_{re.sub(r'[^a-z0-9]+', '_', r.path.lower()).strip('_')}",
            "summary": r.summary,
            "parameters": parameters,
            "responses": responses,
        }
        if r.body is not None:
            op["requestBody"] = {
                "required": r.body_required,
                "content": {"application/json": {"schema": keys[(r.body, "validation")]}},
            }
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "parameters": {
                "IdempotencyKey": {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": True,
                    "description": "the same key and request replay the stored answer; another "
                    "request with this key is a 409 idempotency_conflict",
                    "schema": {"type": "string", "pattern": KEY_RE.pattern},
                },
                "Person": {
                    "name": PERSON_HEADER,
                    "in": "header",
                    "required": False,
                    "description": "the ops console's signed assertion of the person it acts for (its token only): "
                    "the change is done with that person's rights and audited under their name; otherwise the "
                    "audit names the token's principal (an X-Actor header is not read)",
                    "schema": {"type": "string"},
                },
                "XRequestId": {
                    "name": "X-Request-Id",
                    "in": "header",
                    "required": False,
                    "description": "echoed back on every answer; minted when absent or malformed",
                    "schema": {"type": "string"},
                },
            },
            "schemas": defs.get("$defs", {}),
        },
    }


def render_yaml(doc: dict[str, Any]) -> str:
    import yaml

    header = "# Generated from the routes and pydantic models; do not edit (a test fails on drift).\n"
    plain = json.loads(json.dumps(doc))  # no shared objects, so no YAML anchors
    return header + yaml.safe_dump(plain, sort_keys=False, width=120, allow_unicode=True)
