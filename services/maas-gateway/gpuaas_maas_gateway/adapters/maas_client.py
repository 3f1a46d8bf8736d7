"""Async client of the MAAS REST API 2.0 for the gateway.

Every call is OAuth 1.0 PLAINTEXT signed and bounded by a per-call timeout. Failures surface as
the `maas_errors` hierarchy, whose `outcome_unknown` tells the caller whether a mutation might
have been committed anyway (then: poll `read_machine`, do not resubmit blindly).

The API key is held in a private object that never renders itself, is never bound into a log,
and is scrubbed from any error body MAAS echoes back (a 401 names the token it rejected).
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode, urlparse

import aiohttp
import structlog
from oauthlib import oauth1

from .maas_errors import MaasError, MaasNoResponse, MaasUnreachable, error_for_status
from .maas_models import Machine

log = structlog.get_logger("gpuaas_maas_gateway.maas_client")

_REDACTED = "**redacted**"
Filter = str | int | Iterable[str | int] | None


class _Credentials:
    """The three parts of a MAAS API key; deliberately opaque to repr, str and pickling."""

    __slots__ = ("_consumer_key", "_token_key", "_token_secret")

    def __init__(self, api_key: str) -> None:
        parts = api_key.strip().split(":")
        if len(parts) != 3 or not all(parts):
            # Never echo the value: a malformed key is still mostly a secret.
            raise ValueError("a MAAS API key has three colon-separated parts")
        self._consumer_key, self._token_key, self._token_secret = parts

    def signer(self) -> oauth1.Client:
        return oauth1.Client(
            self._consumer_key,
            client_secret="",
            resource_owner_key=self._token_key,
            resource_owner_secret=self._token_secret,
            signature_method=oauth1.SIGNATURE_PLAINTEXT,
            signature_type=oauth1.SIGNATURE_TYPE_AUTH_HEADER,
            realm="OAuth",
        )

    def scrub(self, text: str) -> str:
        for part in (self._token_secret, self._token_key, self._consumer_key):
            text = text.replace(part, _REDACTED)
        return text

    def __repr__(self) -> str:
        return "<MAAS credentials>"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("MAAS credentials cannot be pickled")


def api_root(url: str) -> str:
    """Accept `http://host:5240/MAAS/` or the full `…/MAAS/api/2.0/`, like the MAAS CLI does."""
    parsed = urlparse(url)
    path = parsed.path if parsed.path.endswith("/") else parsed.path + "/"
    if not path.rstrip("/").endswith("/api/2.0"):
        path += "api/2.0/"
    return parsed._replace(path=path, query="", fragment="").geturl()


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _pairs(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Flatten to MAAS form pairs: lists repeat the key, booleans are true/false, None is omitted."""
    out: list[tuple[str, str]] = []
    for key, value in data.items():
        values = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
        for item in values:
            if item is None:
                continue
            if isinstance(item, bool):
                item = "true" if item else "false"
            out.append((key, str(item)))
    return out


class MaasClient:
    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._root = api_root(url)
        self._credentials = _Credentials(api_key)
        self._timeout = timeout
        self._session = session
        self._owns_session = session is None
        self._log = log.bind(maas_api=self._root)

    def __repr__(self) -> str:
        return f"MaasClient(url={self._root!r}, timeout={self._timeout!r})"

    __str__ = __repr__

    async def __aenter__(self) -> MaasClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
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

    # ---- API -----------------------------------------------------------------------------------

    async def version(self, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._call("GET", "version/", operation="version", timeout=timeout)

    async def list_machines(self, *, timeout: float | None = None, **filters: Filter) -> list[Machine]:
        """Filters as MAAS names them (hostname, id, tags, status, agent_name, …); lists repeat."""
        data = await self._call("GET", "machines/", operation="list_machines", query=filters, timeout=timeout)
        return [Machine.from_json(m) for m in data]

    async def read_machine(self, system_id: str, *, timeout: float | None = None) -> Machine:
        data = await self._call(
            "GET",
            f"machines/{system_id}/",
            operation="read_machine",
            system_id=system_id,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def allocate(
        self,
        system_id: str | None = None,
        agent_name: str | None = None,
        comment: str | None = None,
        *,
        tags: Iterable[str] | None = None,
        timeout: float | None = None,
    ) -> Machine:
        """Not idempotent: after an unknown outcome, look for the machine by `agent_name`."""
        form = {
            "system_id": system_id,
            "agent_name": agent_name,
            "comment": comment,
            "tags": list(tags) if tags is not None else None,
        }
        data = await self._call(
            "POST",
            "machines/",
            op="allocate",
            operation="allocate",
            form=form,
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def deploy(
        self,
        system_id: str,
        distro_series: str,
        user_data: bytes | str | None = None,
        hwe_kernel: str | None = None,
        agent_name: str | None = None,
        comment: str | None = None,
        *,
        timeout: float | None = None,
    ) -> Machine:
        """`user_data` is the raw document (cloud-config, script); it is base64-encoded here."""
        encoded = None
        if user_data is not None:
            raw = user_data.encode("utf-8") if isinstance(user_data, str) else user_data
            encoded = base64.b64encode(raw).decode("ascii")
        form = {
            "distro_series": distro_series,
            "user_data": encoded,
            "hwe_kernel": hwe_kernel,
            "agent_name": agent_name,
            "comment": comment,
        }
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="deploy",
            operation="deploy",
            form=form,
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def release(
        self,
        system_id: str,
        erase: bool = False,
        quick_erase: bool = False,
        secure_erase: bool = False,
        comment: str | None = None,
        *,
        timeout: float | None = None,
    ) -> Machine:
        form = {
            "erase": erase or None,
            "quick_erase": quick_erase or None,
            "secure_erase": secure_erase or None,
            "comment": comment,
        }
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="release",
            operation="release",
            form=form,
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def commission(
        self,
        system_id: str,
        commissioning_scripts: Iterable[str] | None = None,
        testing_scripts: Iterable[str] | None = None,
        enable_ssh: bool | None = None,
        skip_bmc_config: bool | None = None,
        skip_networking: bool | None = None,
        skip_storage: bool | None = None,
        *,
        timeout: float | None = None,
    ) -> Machine:
        form = {
            # MAAS takes script lists comma-separated.
            "commissioning_scripts": ",".join(commissioning_scripts) if commissioning_scripts else None,
            "testing_scripts": ",".join(testing_scripts) if testing_scripts else None,
            "enable_ssh": enable_ssh,
            "skip_bmc_config": skip_bmc_config,
            "skip_networking": skip_networking,
            "skip_storage": skip_storage,
        }
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="commission",
            operation="commission",
            form=form,
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    async def abort(self, system_id: str, comment: str | None = None, *, timeout: float | None = None) -> Machine:
        data = await self._call(
            "POST",
            f"machines/{system_id}/",
            op="abort",
            operation="abort",
            form={"comment": comment},
            system_id=system_id,
            mutation=True,
            timeout=timeout,
        )
        return Machine.from_json(data)

    # ---- tags, scripts, boot resources ---------------------------------------------------------

    async def create_tag(
        self, name: str, comment: str | None = None, definition: str | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        return await self._call(
            "POST",
            "tags/",
            operation="create_tag",
            mutation=True,
            timeout=timeout,
            form={"name": name, "comment": comment, "definition": definition},
        )

    async def list_tags(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return await self._call("GET", "tags/", operation="list_tags", timeout=timeout)

    async def update_tag_nodes(
        self, name: str, add: Iterable[str] = (), remove: Iterable[str] = (), *, timeout: float | None = None
    ) -> dict[str, int]:
        return await self._call(
            "POST",
            f"tags/{name}/",
            op="update_nodes",
            operation="update_tag_nodes",
            mutation=True,
            form={"add": list(add), "remove": list(remove)},
            timeout=timeout,
        )

    async def create_script(
        self, name: str, script: str, script_type: str = "commissioning", *, timeout: float | None = None
    ) -> dict[str, Any]:
        return await self._call(
            "POST",
            "scripts/",
            operation="create_script",
            mutation=True,
            timeout=timeout,
            form={"name": name, "script": script, "type": script_type},
        )

    async def read_script(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._call("GET", f"scripts/{name}/", operation="read_script", timeout=timeout)

    async def list_boot_resources(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return await self._call(
            "GET", "boot-resources/", operation="list_boot_resources", query={"type": "uploaded"}, timeout=timeout
        )

    async def read_boot_resource(self, resource_id: int, *, timeout: float | None = None) -> dict[str, Any]:
        return await self._call(
            "GET", f"boot-resources/{resource_id}/", operation="read_boot_resource", timeout=timeout
        )

    async def create_boot_resource(
        self,
        name: str,
        architecture: str,
        sha256: str,
        size: int,
        *,
        title: str = "",
        filetype: str = "tgz",
        base_image: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Announce a file by sha256 and size; its bytes follow through `upload_chunk`."""
        form = {
            "name": name,
            "architecture": architecture,
            "sha256": sha256,
            "size": size,
            "title": title or None,
            "filetype": filetype,
            "base_image": base_image,
        }
        return await self._call(
            "POST", "boot-resources/", operation="create_boot_resource", mutation=True, form=form, timeout=timeout
        )

    async def upload_chunk(self, upload_uri: str, chunk: bytes, *, timeout: float | None = None) -> None:
        """PUT one chunk to a file's `upload_uri` (an absolute path, as MAAS reports it)."""
        root_path = urlparse(self._root).path
        if not upload_uri.startswith(root_path):
            raise ValueError(f"upload_uri {upload_uri!r} is not under the API root")
        await self._call(
            "PUT",
            upload_uri[len(root_path) :],
            operation="upload_chunk",
            mutation=True,
            raw_body=chunk,
            timeout=timeout,
        )


__all__ = ["MaasClient", "MaasError", "api_root"]
