"""A simulated baremetal machine: it "boots" when the MAAS simulator says Deployed, and leaves when MAAS has it back.

Only for the simulated fleet. Booting does what a real machine's first boot does before the agent starts:
cloud-init writes the files of the deploy's user-data (exactly the bytes the gateway sent, as the MAAS
simulator recorded them) into the machine's root, a fresh one per deployment as MAAS installs a fresh OS.
The fleet then runs the production agent's baremetal role on that root (fleet.py); nothing here enrols.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath

import aiohttp
import yaml

from gpuaas_common.identity.tls import client_context
from gpuaas_common.logging import get_logger

from ..maas_sim.control import sim_user_data_headers

log = get_logger(__name__)


class UserDataRefused(ValueError):
    pass


def write_cloud_init_files(user_data: str, root: Path) -> list[Path]:
    """cloud-init's `write_files` of a cloud-config document, under `root`, with their permissions. Whatever
    else the document asks (packages, runcmd) a simulated machine has no use for."""
    try:
        doc = yaml.safe_load(user_data or "")
    except yaml.YAMLError as exc:
        raise UserDataRefused(f"user-data is not YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise UserDataRefused("user-data is not a cloud-config mapping")
    written = []
    for entry in doc.get("write_files") or ():
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise UserDataRefused("a write_files entry has no path")
        host_path = PurePosixPath(entry["path"])
        if not host_path.is_absolute() or ".." in host_path.parts:
            raise UserDataRefused(f"write_files path {entry['path']!r} is not a plain absolute path")
        target = root.joinpath(*host_path.parts[1:])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(str(entry.get("content") or ""))
        os.chmod(target, int(str(entry.get("permissions") or "0644"), 8))
        written.append(target)
    return written


class SimulatedBaremetalHost:
    def __init__(
        self,
        node_id: str,
        system_id: str,
        maas_sim_url: str,
        boot: Callable[[str], Awaitable[None]],
        leave: Callable[[], Awaitable[None]],
        poll_interval_s: float = 0.25,
        ca_file: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.node_id = node_id
        # The simulator shows the deploy's user-data only with its key (`sim_user_data_headers`).
        self.headers = sim_user_data_headers(api_key) if api_key else {}
        # The simulator's HTTPS certificate is verified against this CA only (the dev stack's).
        self.ca_file = ca_file
        self.system_id = system_id
        self.url = maas_sim_url.rstrip("/") + f"/_sim/machines/{system_id}"
        # Given the deploy's user-data once per deployment; `leave` ends what it started.
        self.boot = boot
        self.leave = leave
        self.poll_interval_s = poll_interval_s
        self._booted_for: str | None = None

    async def run(self) -> None:
        tls = client_context(self.ca_file) if self.ca_file else True
        connector = aiohttp.TCPConnector(ssl=tls)
        refused = False
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as http:
            while True:
                try:
                    async with http.get(self.url, headers=self.headers) as resp:
                        data = await resp.json()
                except aiohttp.ClientConnectorCertificateError as exc:
                    if not refused:  # said once: a machine that cannot trust MAAS never learns it was deployed
                        log.warning("sim_baremetal_maas_tls_refused", node_id=self.node_id, error=str(exc)[:200])
                        refused = True
                    await asyncio.sleep(self.poll_interval_s)
                    continue
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    await asyncio.sleep(self.poll_interval_s)
                    continue
                status = data.get("status_name")
                last = (data.get("_sim") or {}).get("last_deploy") or {}
                user_data = last.get("user_data") or ""
                # One boot per deployment: the recorded deploy is told apart by its user-data (a new allocation's
                # token and credentials), as a redeploy is a new first boot.
                if status == "Deployed" and user_data != self._booted_for:
                    await self.leave()
                    self._booted_for = user_data
                    await self.boot(user_data)
                elif status != "Deployed":
                    if self._booted_for is not None:
                        await self.leave()
                    self._booted_for = None
                await asyncio.sleep(self.poll_interval_s)


def fresh_root(root: Path) -> None:
    """A new deployment's OS: nothing of the previous tenant's files survives it."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
