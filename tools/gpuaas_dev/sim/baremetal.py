"""A simulated baremetal host: it "boots" when the MAAS simulator says Deployed and enrols.

Only for the simulated fleet. A real host gets the same env file from cloud-init user_data and its
agent enrols on start; here we read the user_data the simulator recorded for the last deploy.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

import aiohttp
import yaml

from gpuaas_common.bus import PermanentError
from gpuaas_common.logging import get_logger

log = get_logger(__name__)

_ENV_LINE = re.compile(r"^\s*(GPUAAS_[A-Z_]+)=(\S+)\s*$", re.MULTILINE)
NODE_CREDS_PATH = "/etc/gpuaas/node.creds"


def parse_agent_env(user_data: str) -> dict[str, str]:
    return dict(_ENV_LINE.findall(user_data or ""))


def parse_node_creds(user_data: str) -> str | None:
    """The NATS creds file the deploy's cloud-config writes for the agent, as cloud-init would."""
    try:
        doc = yaml.safe_load(user_data or "")
    except yaml.YAMLError:
        return None
    if not isinstance(doc, dict):
        return None
    for entry in doc.get("write_files") or ():
        if isinstance(entry, dict) and entry.get("path") == NODE_CREDS_PATH:
            return str(entry.get("content") or "") or None
    return None


# After enrolling, the host says so again after each of these pauses (the last one repeating): the allocator may
# have lost its commit of the first announcement (Postgres losing acknowledged commits), and only the host can
# tell it again. The allocator applies an enrolment it already has as a no-op.
ANNOUNCE_AGAIN_S = (20.0, 40.0, 80.0, 160.0, 320.0, 600.0)


class SimulatedBaremetalHost:
    def __init__(
        self,
        node_id: str,
        system_id: str,
        maas_sim_url: str,
        enrol: Callable[[dict[str, str], str | None, int], Awaitable[None]],
        leave: Callable[[], Awaitable[None]] | None = None,
        poll_interval_s: float = 0.25,
        returned: Callable[[], Awaitable[None]] | None = None,
        announce_again_s: tuple[float, ...] = ANNOUNCE_AGAIN_S,
    ) -> None:
        self.announce_again_s = announce_again_s
        self._announced = 0
        self._announce_at = 0.0
        self.leave = leave
        # Called once the machine is Ready again after a tenant's deployment (a slice host's way back).
        self.returned = returned
        self._away = False
        self.node_id = node_id
        self.system_id = system_id
        self.url = maas_sim_url.rstrip("/") + f"/_sim/machines/{system_id}"
        self.enrol = enrol
        self.poll_interval_s = poll_interval_s
        self._enrolled_for: str | None = None

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while True:
                try:
                    async with http.get(self.url) as resp:
                        data = await resp.json()
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    await asyncio.sleep(self.poll_interval_s)
                    continue
                status = data.get("status_name")
                last = (data.get("_sim") or {}).get("last_deploy") or {}
                env = parse_agent_env(last.get("user_data") or "")
                allocation = env.get("GPUAAS_ALLOCATION_ID")
                if status == "Deployed" and allocation and allocation == self._enrolled_for:
                    await self._announce_again_if_due(env, allocation)
                elif status == "Deployed" and allocation and allocation != self._enrolled_for:
                    try:
                        await self.enrol(env, parse_node_creds(last.get("user_data") or ""), 0)
                        log.info("sim_baremetal_enrolled", node_id=self.node_id, allocation_id=allocation)
                    except PermanentError as exc:
                        # A host whose enrolment is refused (revoked or expired credentials, no token) stays up
                        # and says why; it does not take the fleet process down, nor ask again.
                        log.warning(
                            "sim_baremetal_enrol_refused",
                            node_id=self.node_id,
                            allocation_id=allocation,
                            error=str(exc),
                        )
                    except Exception as exc:
                        # Anything else (a publish timed out while a NATS server was down: a chaos run lost an
                        # enrolment that way) is tried again at the next poll, as a real host's agent does.
                        log.warning(
                            "sim_baremetal_enrol_failed", node_id=self.node_id, allocation_id=allocation, error=str(exc)
                        )
                        await asyncio.sleep(self.poll_interval_s)
                        continue
                    self._enrolled_for = allocation
                    self._away = True
                    self._announced = 0
                    self._announce_at = asyncio.get_running_loop().time() + self.announce_again_s[0]
                elif status != "Deployed":
                    if self._enrolled_for is not None and self.leave is not None:
                        await self.leave()
                    self._enrolled_for = None
                    if status == "Ready" and self._away:
                        self._away = False
                        if self.returned is not None:
                            await self.returned()
                await asyncio.sleep(self.poll_interval_s)

    async def _announce_again_if_due(self, env: dict[str, str], allocation: str) -> None:
        now = asyncio.get_running_loop().time()
        if not self.announce_again_s or now < self._announce_at:
            return
        self._announced += 1
        pauses = self.announce_again_s
        self._announce_at = now + pauses[min(self._announced, len(pauses) - 1)]
        try:
            await self.enrol(env, None, self._announced)
        except Exception as exc:  # the next pause brings the next try
            log.warning("sim_baremetal_announce_failed", node_id=self.node_id, allocation_id=allocation, error=str(exc))
