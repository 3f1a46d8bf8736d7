"""Renewal of a deployment's creds files, by the one process that holds the keys (compose: this container).

Each role's file and each slice host's file past half its life is issued again, keeping its owner (each file's one
reader); the processes reading them switch without a gap (`gpuaas_common.creds_renewal`). A renewed host user is
recorded in the ledger before its file is written, and a host whose user was revoked is left alone
(`gpuaas_common.identity.rotation`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuaas_common.identity import Authority
from gpuaas_common.identity.rotation import host_files, renew_host_files, renew_role_files
from gpuaas_common.logging import get_logger

from ..adapters.ledger import Ledger

log = get_logger(__name__)


async def renew_once(
    authority: Authority, keys_dir: Path, creds_dir: Path, hosts_dir: Path | None, ledger: Ledger
) -> list[str]:
    roles = renew_role_files(authority, creds_dir)
    hosts: dict[str, str] = {}
    if hosts_dir is not None:
        hosts = await renew_host_files(
            authority, host_files(hosts_dir), js=ledger.js, nats_servers=ledger.servers, tls=ledger.tls
        )
        authority.save(keys_dir)  # the hosts' users it issued, so decommissioning revokes them
    renewed = roles + [node for node, outcome in hosts.items() if outcome == "renewed"]
    left = {node: outcome for node, outcome in hosts.items() if outcome != "renewed"}
    if renewed or left:
        log.info("creds_renewed", renewed=renewed, left_alone=left)
    return renewed


async def renew_forever(
    authority: Authority, keys_dir: Path, creds_dir: Path, hosts_dir: Path | None, ledger: Ledger, every_s: float
) -> None:
    while True:
        try:
            await renew_once(authority, keys_dir, creds_dir, hosts_dir, ledger)
        except Exception as exc:  # the bus away for a round: every file still has half its life
            log.warning("creds_not_renewed", error=f"{type(exc).__name__}: {exc}"[:300])
        await asyncio.sleep(every_s)  # the period between rounds, not a wait for anything
