"""The credential authority as the gateway asks it (services/credential-authority): HTTPS with the deployment's CA
pinned, each request signed with the gateway's own bus identity (`gpuaas_common.identity.signed_request`). The
gateway holds no signing key: it can ask for a baremetal host's user for an allocation, the revocation of what was
minted for an allocation (which ends the allocation: no host user is minted for it after), a slice host's own user
(a slice-host redeploy), and the end of a slice host's identity, and nothing else. A mint names the deploy command
it is for by its MAAS stream sequence: the authority reads that command itself and mints only what it asks for."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.signed_request import HEADER, sign
from gpuaas_common.identity.tls import client_context

TIMEOUT_S = 15.0


class AuthorityRefused(RuntimeError):
    """The authority answered with an error (its code and message; never a secret)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Minted:
    creds: str
    user: str
    expires_at: int


class AuthorityClient:
    def __init__(self, url: str, ca_file: str, creds_file: str) -> None:
        self.url = url.rstrip("/")
        self.tls = client_context(ca_file)
        # Read at each request: the file is renewed in place while the gateway runs.
        self.creds_file = Path(creds_file)

    async def mint(self, node_id: str, allocation_id: str, ttl_s: float, *, deploy_command_seq: int) -> Minted:
        body = {"node_id": node_id, "allocation_id": allocation_id, "ttl_s": ttl_s}
        out = await self._post("/v1/host-users", body | {"deploy_command_seq": deploy_command_seq})
        return Minted(str(out["creds"]), str(out["user"]), int(out["expires_at"]))

    async def mint_slice_host(self, node_id: str, walk_id: str, *, deploy_command_seq: int) -> Minted:
        body = {"walk_id": walk_id, "deploy_command_seq": deploy_command_seq}
        out = await self._post(f"/v1/nodes/{node_id}/slice-host-user", body)
        return Minted(str(out["creds"]), str(out["user"]), int(out["expires_at"]))

    async def revoke_allocation(self, allocation_id: str) -> int:
        return int((await self._post(f"/v1/allocations/{allocation_id}/revoke", None))["revoked"])

    async def end_slice_identity(self, node_id: str) -> int:
        return int((await self._post(f"/v1/nodes/{node_id}/end-slice-identity", None))["revoked"])

    async def _post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = b"" if body is None else json.dumps(body).encode()
        header = sign(creds_files.read(self.creds_file), "POST", path, data)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session:
            async with session.post(
                self.url + path,
                data=data,
                headers={HEADER: header, "Content-Type": "application/json"},
                ssl=self.tls,
            ) as resp:
                answer = await resp.json(content_type=None)
                if resp.status >= 300:
                    error = (answer or {}).get("error") or {}
                    raise AuthorityRefused(resp.status, str(error.get("code")), str(error.get("message")))
                return dict(answer)
