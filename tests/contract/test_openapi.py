"""The committed OpenAPI documents are rendered from the admin routes and their pydantic models: a route,
a model or a status changed without re-rendering fails here. In each document every mutation requires an
Idempotency-Key and every error is the shared shape. (tests/integration/test_admin_fuzz.py loads them with
schemathesis, which refuses an invalid document, and holds the live APIs to them.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuaas_common.admin_http import render_yaml
from gpuaas_image_pipeline.entrypoints.admin_http import openapi_document as image_document
from gpuaas_ops_view.entrypoints.admin_http import openapi_document as ops_view_document
from gpuaas_scheduler.entrypoints.admin_http import openapi_document as scheduler_document

ROOT = Path(__file__).resolve().parents[2]
DOCS: dict[str, tuple[Path, Callable[[], dict[str, Any]], str]] = {
    "scheduler": (ROOT / "services/scheduler/openapi.yaml", scheduler_document, "gpuaas_scheduler"),
    "image-pipeline": (ROOT / "services/image-pipeline/openapi.yaml", image_document, "gpuaas_image_pipeline"),
    "ops-view": (ROOT / "services/ops-view/openapi.yaml", ops_view_document, "gpuaas_ops_view"),
}


@pytest.mark.parametrize("service", DOCS)
def test_committed_openapi_equals_the_rendered_one(service: str) -> None:
    path, render, package = DOCS[service]
    assert path.read_text() == render_yaml(render()), (
        f"{path.relative_to(ROOT)} is stale: run "
        f".venv/bin/python -m {package}.entrypoints.admin_http {path.relative_to(ROOT)}"
    )


@pytest.mark.parametrize("service", DOCS)
def test_openapi_is_valid_and_states_the_shared_rules(service: str) -> None:
    path = DOCS[service][0]
    doc = yaml.safe_load(path.read_text())
    assert doc["openapi"] == "3.1.0"
    for route, ops in doc["paths"].items():
        for method, op in ops.items():
            refs = [p.get("$ref") for p in op["parameters"]]
            if method in ("post", "put", "patch", "delete"):
                assert "#/components/parameters/IdempotencyKey" in refs, (method, route)
                assert {"400", "409"} <= set(op["responses"]), (method, route)
            assert "401" in op["responses"], (method, route)
            for status, resp in op["responses"].items():
                schema = resp["content"]["application/json"]["schema"]
                if status.startswith("4") or status.startswith("5"):
                    assert schema == {"$ref": "#/components/schemas/Error"}, (method, route, status)
