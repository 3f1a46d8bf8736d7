"""The dev stack's two admin APIs, reached as the README tells a developer to: the URL from stack.json, the
token from secrets.json (owner-only). Each answers its own token, refuses no token and the other API's
token, and answers what no route handles in the one error shape."""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
import pytest

pytestmark = pytest.mark.e2e

# service -> (key prefix in stack.json / secrets.json, a list route)
ADMIN_APIS = {"scheduler": ("scheduler", "/v1/nodes"), "image-pipeline": ("image", "/v1/images")}
ERROR_KEYS = {"code", "message", "details", "request_id"}


def _as_a_developer_reads_them(stack) -> tuple[dict[str, Any], dict[str, Any]]:
    secrets_file = stack.run_dir / "secrets.json"
    assert secrets_file.stat().st_mode & 0o077 == 0, "secrets.json is readable by others"
    return json.loads((stack.run_dir / "stack.json").read_text()), json.loads(secrets_file.read_text())


async def _call(method: str, url: str, token: str | None, **kw: Any) -> tuple[int, Any, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    headers.update(kw.pop("headers", {}))
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, headers=headers, **kw) as resp:
            return resp.status, resp.headers.copy(), await resp.json()  # headers case-insensitive


def _is_error(body: dict[str, Any], code: str, headers: Any) -> None:
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["code"] == code and body["error"]["request_id"] == headers["X-Request-Id"]


@pytest.mark.parametrize("service", list(ADMIN_APIS))
async def test_each_admin_api_answers_its_token_from_secrets_json(stack, service: str) -> None:
    described, secrets = _as_a_developer_reads_them(stack)
    prefix, listing = ADMIN_APIS[service]
    url, token = described[f"{prefix}_admin_url"], secrets[f"{prefix}_admin_token"]
    assert url == stack.admin_url(service) and token not in json.dumps(described)

    status, _, body = await _call("GET", f"{url}{listing}", token)
    assert status == 200 and body, body

    other = next(secrets[f"{p}_admin_token"] for p, _ in ADMIN_APIS.values() if p != prefix)
    for wrong in (None, "", other):
        status, headers, body = await _call("GET", f"{url}{listing}", wrong)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        _is_error(body, "unauthorized", headers)

    status, headers, body = await _call("GET", f"{url}/v1/nowhere", token)
    assert status == 404
    _is_error(body, "not_found", headers)
    status, headers, body = await _call("DELETE", f"{url}{listing}", token, headers={"Idempotency-Key": "k"})
    assert status == 405 and "GET" in headers["Allow"]
    _is_error(body, "method_not_allowed", headers)


async def test_the_readme_operations_work_on_the_dev_stack(stack) -> None:
    """Drain, slot approval and quota as the README's curl lines do them."""
    described, secrets = _as_a_developer_reads_them(stack)
    url, token = described["scheduler_admin_url"], secrets["scheduler_admin_token"]
    node = next(n.node_id for n in stack.fleet.nodes if n.kind == "slice_host")

    def key() -> dict[str, str]:
        return {"Idempotency-Key": uuid.uuid4().hex}

    status, _, body = await _call(
        "POST", f"{url}/v1/nodes/{node}/drain", token, json={"actor": "ops", "reason": "try"}, headers=key()
    )
    assert status == 200 and body["node"]["node_id"] == node and body["node"]["draining"], body
    status, _, body = await _call(
        "POST", f"{url}/v1/nodes/{node}/undrain", token, json={"actor": "ops", "reason": "done"}, headers=key()
    )
    assert status == 200 and not body["node"]["draining"], body
    status, _, body = await _call(
        "POST",
        f"{url}/v1/nodes/{node}/candidates/approve",
        token,
        json={"actor": "ops", "reason": "disks checked"},
        headers=key(),
    )
    assert status == 200 and body["results"], body
    assert {(r["status"], tuple(r["problems"])) for r in body["results"]} == {("available", ())}, body
    status, _, body = await _call(
        "PUT",
        f"{url}/v1/tenants/tenant-readme/quota",
        token,
        json={"actor": "ops", "reason": "try", "max_gpus": 8},
        headers=key(),
    )
    assert status == 200 and body["quota"]["max_gpus"] == 8, body
