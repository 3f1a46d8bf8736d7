"""The dev stack earns its slice capacity the way a real fleet does, then approves it as `gpuaas-dev`.

The scheduler seeds the fleet file's hosts with parity unknown and their slot bundles as unapproved
candidates without disk evidence (nothing placeable). Each simulated host's agent then reports its
topology (candidates with disk evidence, replacing the seeded ones) and a parity run. Once both are in,
the stack approves the complete discovered candidates through the scheduler's admin API, exactly as ops
would, with actor `gpuaas-dev`: the slots, their transition log and the admin audit all name it. A host
whose parity fails or whose candidates do not pass the approval rules stops the start with the reasons.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp

from gpuaas_common.fleet import Fleet

DEV_ACTOR = "gpuaas-dev"
DEV_REASON = "dev stack: simulated host discovered by its agent and parity-clean"


class ApprovalFailed(Exception):
    pass


async def approve_slice_hosts(
    admin_url: str, token: str, fleet: Fleet, timeout_s: float, profiles: dict[str, str] | None = None
) -> dict[str, list[str]]:
    """Wait for every slice host's topology and parity report, then approve its complete discovered
    candidates (with the runtime profile `profiles` names for the host, else each candidate's own). Returns
    node -> approved slot ids. A lab host's emulated candidates are complete without a fabric VF."""
    hosts = [n.node_id for n in fleet.nodes if n.kind == "slice_host"]
    headers = {"Authorization": f"Bearer {token}"}
    approved: dict[str, list[str]] = {}
    async with aiohttp.ClientSession(base_url=admin_url, headers=headers) as http:
        deadline = time.monotonic() + timeout_s
        for node_id in hosts:
            node = await _wait_for_evidence(http, node_id, deadline, timeout_s)
            if node["parity_failures"]:
                failed = [c for c in (node.get("parity_detail") or {}).get("checks", []) if c.get("status") == "FAIL"]
                raise ApprovalFailed(f"{node_id}: parity run reported {node['parity_failures']} failure(s): {failed}")
            candidates = (await _call(http, "GET", f"/v1/nodes/{node_id}/candidates"))["candidates"]
            complete = [
                c["candidate_id"]
                for c in candidates
                if c["source"] == "node-agent"
                and c["approved_slot_id"] is None
                and c["nvme_by_id"]
                and (c["fabric_vf_pci_address"] or c.get("emulated"))
                and c["nvme_evidence"] is not None
            ]
            if not complete:
                raise ApprovalFailed(f"{node_id}: discovery reported no complete candidate: {candidates}")
            answer = await _call(
                http,
                "POST",
                f"/v1/nodes/{node_id}/candidates/approve",
                {
                    "actor": DEV_ACTOR,
                    "reason": DEV_REASON,
                    "candidate_ids": complete,
                    **({"profile": profiles[node_id]} if profiles and node_id in profiles else {}),
                },
            )
            refused = [r for r in answer["results"] if r["status"] != "available"]
            if refused:
                raise ApprovalFailed(f"{node_id}: approval rules refused discovered candidates: {refused}")
            approved[node_id] = [r["slot_id"] for r in answer["results"]]
    return approved


async def _wait_for_evidence(
    http: aiohttp.ClientSession, node_id: str, deadline: float, timeout_s: float
) -> dict[str, Any]:
    while True:
        node = (await _call(http, "GET", f"/v1/nodes/{node_id}"))["node"]
        if node["topology_reported_at"] is not None and node["parity_failures"] is not None:
            return node
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{node_id}: no topology and parity report from its agent within {timeout_s:.0f}s "
                f"(topology_reported_at={node['topology_reported_at']}, parity_failures={node['parity_failures']})"
            )
        await asyncio.sleep(0.2)


async def _call(http: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> Any:
    headers = {"Idempotency-Key": uuid.uuid4().hex, "X-Actor": DEV_ACTOR} if method != "GET" else {}
    async with http.request(method, path, json=body, headers=headers) as resp:
        data = await resp.json()
        if resp.status >= 400:
            raise ApprovalFailed(f"{method} {path}: {resp.status} {data}")
        return data
