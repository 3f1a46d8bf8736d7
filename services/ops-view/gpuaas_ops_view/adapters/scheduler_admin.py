"""The scheduler's admin API as the console uses it: the nodes' admin state (drained, mode, maintenance: the
scheduler's truth, never on the bus), quotas and site wipe policies, and the console's changes (drain, undrain,
slot approval, disable and repair, waivers, quota, wipe policy, force release), under the same Idempotency-Key
and audit as `gpuaas nodes drain` and the other commands. The console calls with its own token (the scheduler's
`ops-console` principal, which by itself only reads) and each change with a signed assertion of the person
signed in, bound to that one request: the scheduler checks that person's rights and audits under their name. The
console holds no scheduler data of its own."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from pydantic import SecretStr

from gpuaas_common.admin_http import PERSON_HEADER, assert_person

TIMEOUT_S = 10.0


class SchedulerUnavailable(Exception):
    """Not configured, unreachable, or an answer that is not the API's."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]

    @property
    def error(self) -> str | None:
        """The API's own words for a refusal, or None for a success."""
        if self.status < 400:
            return None
        err = self.body.get("error") if isinstance(self.body.get("error"), dict) else {}
        said = f"{err.get('code', self.status)}: {err.get('message', '')}".strip()
        # A body the schema refused names each field and what is wrong with it: the page shows which.
        details = err.get("details") if isinstance(err.get("details"), dict) else {}
        fields = [e for e in details.get("errors") or [] if isinstance(e, dict)]
        if fields:
            said += " (" + "; ".join(f"{e.get('loc')}: {e.get('msg')}" for e in fields) + ")"
        return said


class SchedulerAdmin:
    def __init__(self, url: str | None, token: SecretStr | None) -> None:
        self.url = url.rstrip("/") if url else None
        self._token = token
        self._http: aiohttp.ClientSession | None = None

    @property
    def configured(self) -> bool:
        return bool(self.url and self._token and self._token.get_secret_value())

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: dict | None = None,
        headers: dict[str, str] | None = None,
        person: tuple[str, str] | None = None,
    ) -> Answer:
        """`person`: (who, the rights they signed in with), asserted for this one request."""
        if not self.configured:
            raise SchedulerUnavailable(
                "the scheduler admin API is not configured (GPUAAS_SCHEDULER_ADMIN_URL/GPUAAS_SCHEDULER_CONSOLE_TOKEN)"
            )
        assert self._token is not None
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
        sent = {"Authorization": f"Bearer {self._token.get_secret_value()}", "Accept": "application/json"}
        sent.update(headers or {})
        # The bytes signed are the bytes sent.
        raw = json.dumps(body).encode() if body is not None else b""
        if body is not None:
            sent["Content-Type"] = "application/json"
        if person is not None:
            sent[PERSON_HEADER] = assert_person(
                self._token,
                person[0],
                person[1],
                method=method,
                path=path,
                body=raw,
                idempotency_key=sent.get("Idempotency-Key", ""),
            )
        try:
            async with self._http.request(method, f"{self.url}{path}", data=raw or None, headers=sent) as resp:
                answer = await resp.json(content_type=None)
                return Answer(resp.status, answer if isinstance(answer, dict) else {})
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise SchedulerUnavailable(f"the scheduler admin API did not answer: {type(exc).__name__}") from None

    async def nodes(self) -> dict[str, dict[str, Any]]:
        """Every node's admin view, by node id."""
        answer = await self._call("GET", "/v1/nodes")
        if answer.error is not None:
            raise SchedulerUnavailable(f"the scheduler admin API refused the node list ({answer.error})")
        return {n["node_id"]: n for n in answer.body.get("nodes", []) if isinstance(n, dict) and "node_id" in n}

    async def node(self, node_id: str) -> dict[str, Any] | None:
        """A node's admin detail (mode history, waivers, actions asked of it); None when the scheduler has none."""
        answer = await self._call("GET", f"/v1/nodes/{quote(node_id, safe='')}")
        if answer.status == 404:
            return None
        if answer.error is not None:
            raise SchedulerUnavailable(f"the scheduler admin API refused the node ({answer.error})")
        return answer.body

    async def read(self, path: str) -> Answer:
        """A view the console shows as the API answers it (a quota, a site's wipe policy), refusal included."""
        return await self._call("GET", path)

    async def act(
        self,
        path: str,
        body: dict[str, Any],
        *,
        actor: str,
        rights: str,
        idempotency_key: str,
        request_id: str,
        method: str = "POST",
    ) -> Answer:
        """One change for `actor`, signed in with `rights`, sent as the CLI sends it (the body's actor and reason,
        an Idempotency-Key) with the assertion of that person; the console's request id travels with it, so the
        scheduler's audit row and the console's log name the same request."""
        return await self._call(
            method,
            path,
            body={"actor": actor, **body},
            headers={"Idempotency-Key": idempotency_key, "X-Request-Id": request_id},
            person=(actor, rights),
        )

    @staticmethod
    def node_path(node_id: str, action: str) -> str:
        return f"/v1/nodes/{quote(node_id, safe='')}/{action}"

    @staticmethod
    def force_release_path(allocation_id: str) -> str:
        return f"/v1/allocations/{quote(allocation_id, safe='')}/force-release"

    @staticmethod
    def slot_path(slot_id: str, action: str) -> str:
        return f"/v1/slots/{quote(slot_id, safe='')}/{action}"

    @staticmethod
    def approve_path(node_id: str) -> str:
        return f"/v1/nodes/{quote(node_id, safe='')}/candidates/approve"

    @staticmethod
    def quota_path(tenant_id: str) -> str:
        return f"/v1/tenants/{quote(tenant_id, safe='')}/quota"

    @staticmethod
    def wipe_policy_path(region: str) -> str:
        return f"/v1/sites/{quote(region, safe='')}/wipe-policy"
