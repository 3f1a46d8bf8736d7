"""A simulated slice host's DHCP server and guests, for the dev fleet and tests only.

It plays dnsmasq (reservation file in the hostsdir → lease line in the lease file) and the booted guest
(an SSH banner on the leased IP). Leased IPs must be loopback (127.0.0.0/8, which Linux routes entirely
to `lo`), so the simulation never listens on a real network.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import time
from pathlib import Path

from gpuaas_common.logging import get_logger
from gpuaas_node_agent.adapters.dnsmasq import Reservation, read_reservations

log = get_logger(__name__)

SSH_BANNER = b"SSH-2.0-gpuaas-sim\r\n"
_LEASE_SECONDS = 3600


class SimulatedDhcpAndGuest:
    def __init__(
        self,
        hostsdir: str | os.PathLike[str],
        lease_file: str | os.PathLike[str],
        ssh_port: int,
        *,
        poll_interval_s: float = 0.1,
    ) -> None:
        self.hostsdir = Path(hostsdir)
        self.lease_file = Path(lease_file)
        self.ssh_port = ssh_port
        self.poll_interval_s = poll_interval_s
        self._leases: dict[str, tuple[Reservation, int]] = {}  # by MAC: reservation, expiry
        self._servers: dict[str, asyncio.Server] = {}  # by IP
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self.hostsdir.mkdir(parents=True, exist_ok=True)
            await self.sync()
            self._task = asyncio.create_task(self._run(), name="sim-dhcp-guest")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for ip in list(self._servers):
            await self._stop_guest(ip)

    async def __aenter__(self) -> SimulatedDhcpAndGuest:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    @property
    def bound_ips(self) -> set[str]:
        return set(self._servers)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.sync()
            except Exception:  # the sim must keep serving the other guests
                log.exception("sim_dhcp_sync_failed")

    async def sync(self) -> None:
        """Bring leases and guests in line with the reservation files once."""
        wanted = {r.mac: r for r in (await asyncio.to_thread(read_reservations, self.hostsdir)).values()}
        changed = False
        for mac in list(self._leases):
            reservation, _ = self._leases[mac]
            if wanted.get(mac) != reservation:
                del self._leases[mac]
                await self._stop_guest(reservation.ip)
                changed = True
                log.info("sim_dhcp_released", mac=mac, ip=reservation.ip)
        for mac, reservation in wanted.items():
            if mac in self._leases:
                continue
            if not ipaddress.IPv4Address(reservation.ip).is_loopback:
                log.warning("sim_dhcp_refused_non_loopback", mac=mac, ip=reservation.ip)
                continue
            self._leases[mac] = (reservation, int(time.time()) + _LEASE_SECONDS)
            changed = True
            log.info("sim_dhcp_bound", mac=mac, ip=reservation.ip, hostname=reservation.hostname)
            await self._start_guest(reservation.ip)
        if changed:
            await asyncio.to_thread(self._write_lease_file)

    def _write_lease_file(self) -> None:
        lines = [f"{expiry} {r.mac} {r.ip} {r.hostname} *\n" for r, expiry in self._leases.values()]
        self.lease_file.parent.mkdir(parents=True, exist_ok=True)
        # In place, as dnsmasq does: readers must cope with a file caught mid-rewrite.
        with self.lease_file.open("a+") as f:
            f.seek(0)
            f.truncate()
            f.write("".join(lines))

    async def _start_guest(self, ip: str) -> None:
        if ip in self._servers:
            return
        try:
            server = await asyncio.start_server(self._greet, host=ip, port=self.ssh_port)
        except OSError as exc:
            log.error("sim_guest_listen_failed", ip=ip, port=self.ssh_port, error=str(exc))
            return
        self._servers[ip] = server

    async def _stop_guest(self, ip: str) -> None:
        server = self._servers.pop(ip, None)
        if server is not None:
            server.close()
            # Bounded: wait_closed() also waits for connections a client left open, which may be never.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5.0)

    @staticmethod
    async def _greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(SSH_BANNER)
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 5.0)
