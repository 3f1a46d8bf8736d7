"""The signed, time-bounded HTTP call every MAAS operation goes through, and the session it runs on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any, Self
from urllib.parse import urlencode

import aiohttp
import structlog

from gpuaas_common.identity.tls import client_context

from ..maas_errors import MaasNoResponse, MaasUnreachable, error_for_status
from .auth import _Credentials
from .wire import _pairs, _retry_after, api_root

log = structlog.get_logger("gpuaas_maas_gateway.maas_client")


class MaasTransport:
    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        session: aiohttp.ClientSession | None = None,
        ca_file: str | None = None,
    ) -> None:
        self._root = api_root(url)
        # https:// trusts this CA only (pinned); without it, the system store.
        self._ca_file = ca_file
        self._credentials = _Credentials(api_key)
        self._timeout = timeout
        self._session = session
        self._owns_session = session is None
        self._log = log.bind(maas_api=self._root)

    def __repr__(self) -> str:
        return f"MaasClient(url={self._root!r}, timeout={self._timeout!r})"

    __str__ = __repr__

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            tls = client_context(self._ca_file) if self._ca_file else True
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls))
        return self._session

    # ---- transport -----------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        operation: str,
        op: str | None = None,
        query: Mapping[str, Any] | None = None,
        form: Mapping[str, Any] | None = None,
        system_id: str | None = None,
        mutation: bool = False,
        timeout: float | None = None,
        raw_body: bytes | None = None,
    ) -> Any:
        query_pairs = ([("op", op)] if op else []) + _pairs(query or {})
        url = self._root + path + (("?" + urlencode(query_pairs)) if query_pairs else "")
        headers: dict[str, str] = {"Accept": "application/json"}
        body: bytes | None = None
        if raw_body is not None:
            body = raw_body
            headers["Content-Type"] = "application/octet-stream"
        elif method in ("POST", "PUT"):
            body = urlencode(_pairs(form or {})).encode("ascii")
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        # PLAINTEXT signs neither the URL nor the body, so signing without the body avoids
        # oauthlib's body-parameter rules; a fresh nonce and timestamp are drawn per call.
        _, signed, _ = self._credentials.signer().sign(url, http_method=method)
        headers["Authorization"] = signed["Authorization"]

        budget = self._timeout if timeout is None else timeout
        started = time.monotonic()
        ctx = {"operation": operation, "system_id": system_id, "method": method}
        try:
            async with self._http().request(
                method,
                url,
                data=body,
                headers=headers,
                # A separate connect bound tells "MAAS is down" (nothing sent) from "no answer".
                timeout=aiohttp.ClientTimeout(total=budget, sock_connect=min(budget, 5.0)),
            ) as response:
                raw = await response.read()
                status = response.status
                content_type = response.content_type
                retry_after = response.headers.get("Retry-After")
        except aiohttp.ClientSSLError as error:
            # The handshake failed, so nothing of the request (its key, its body) left us: a server whose certificate
            # our pinned CA did not sign is never spoken to.
            reason = getattr(error, "certificate_error", None) or getattr(error, "os_error", None) or error
            self._log.error("maas_tls_refused", **ctx, error=str(reason)[:300])
            raise MaasUnreachable(
                None,
                f"TLS refused: MAAS's certificate is not trusted by GPUAAS_MAAS_CA_FILE ({str(reason)[:200]})",
                None,
                operation=operation,
                system_id=system_id,
                outcome_unknown=False,
            ) from None
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as error:
            # The TCP connection was never made, so the request cannot have reached MAAS.
            self._log.warning("maas_unreachable", **ctx, error=type(error).__name__)
            raise MaasUnreachable(
                None,
                f"could not connect: {type(error).__name__}",
                None,
                operation=operation,
                system_id=system_id,
                outcome_unknown=False,
            ) from None
        except (TimeoutError, aiohttp.ClientError) as error:
            kind = "timed out" if isinstance(error, asyncio.TimeoutError) else "connection lost"
            self._log.warning(
                "maas_no_response",
                **ctx,
                error=type(error).__name__,
                kind=kind,
                elapsed=round(time.monotonic() - started, 3),
                outcome_unknown=mutation,
            )
            raise MaasNoResponse(
                None,
                f"{kind} after {time.monotonic() - started:.1f}s ({type(error).__name__})",
                None,
                operation=operation,
                system_id=system_id,
                outcome_unknown=mutation,
            ) from None

        elapsed = round(time.monotonic() - started, 3)
        text = self._credentials.scrub(raw.decode("utf-8", errors="replace"))
        if status // 100 != 2:
            error = error_for_status(
                status,
                text,
                _retry_after(retry_after),
                operation=operation,
                system_id=system_id,
                mutation=mutation,
            )
            self._log.warning(
                "maas_error",
                **ctx,
                status=status,
                elapsed=elapsed,
                outcome_unknown=error.outcome_unknown,
                retry_after=error.retry_after,
            )
            raise error
        self._log.debug("maas_call", **ctx, status=status, elapsed=elapsed)
        if content_type.endswith("/json"):
            return json.loads(raw.decode("utf-8"))
        return text

    async def version(self, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._call("GET", "version/", operation="version", timeout=timeout)
