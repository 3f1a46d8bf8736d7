"""A simulated slice host's DHCP server and guests, for the dev fleet and tests only.

It plays dnsmasq (reservation file in the hostsdir → lease line in the lease file) and the booted guest
(an SSH banner on the leased IP, and the agent's readiness login, answered with the GPU report a real guest's
readiness unit writes). Leased IPs must be loopback (127.0.0.0/8, which Linux routes entirely to `lo`), so the
simulation never listens on a real network.

A simulated guest sees the GPUs its domain was given: the `<hostdev>` functions of its libvirt domain that are
NVIDIA 3D controllers on the host (`passed_through_gpus`), with a working driver, as a preinstalled image has.
`faults` makes one guest see less, for tests of the agent's GPU check.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import time
import xml.etree.ElementTree as ET  # noqa: S405 - our own libvirt's XML
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuaas_common.logging import get_logger
from gpuaas_image_pipeline.guest import gpu_report
from gpuaas_node_agent.adapters.dnsmasq import Reservation, read_reservations
from gpuaas_node_agent.adapters.guest_ssh import LoginOutcome
from gpuaas_node_agent.adapters.libvirt_host import LibvirtHost

log = get_logger(__name__)

SSH_BANNER = b"SSH-2.0-gpuaas-sim\r\n"
_LEASE_SECONDS = 3600
SIM_DRIVER_VERSION = "580.159.04"  # the driver of the captured H200 passthrough guest
# The GPUs (host PCI addresses) a VM's domain passes through, by the VM's name.
GpusOf = Callable[[str], Awaitable[list[str]]]


@dataclass(frozen=True)
class GuestFault:
    """What one simulated guest gets wrong: GPUs missing from its PCI bus (one fell off, a bad passthrough),
    its driver (`absent`: no nvidia-smi; `failed`: nvidia-smi cannot talk to a driver), or no report at all."""

    missing_gpus: int = 0
    driver: Literal["loaded", "absent", "failed"] = "loaded"
    no_report: bool = False


def passed_through_gpus(libvirt: LibvirtHost, host_root: str | os.PathLike[str]) -> GpusOf:
    """The domain's `<hostdev>` PCI functions that the host's sysfs shows as NVIDIA 3D controllers."""

    async def gpus(vm_name: str) -> list[str]:
        xml = await libvirt.xml(vm_name)
        if not xml:
            return []
        given = set()
        for addr in ET.fromstring(xml).findall("./devices/hostdev/source/address"):  # noqa: S314
            parts = (int(addr.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function"))
            given.add("{:04x}:{:02x}:{:02x}.{:x}".format(*parts))
        on_host = await asyncio.to_thread(gpu_report.pci_gpus, str(Path(host_root) / "sys"))
        return sorted(g["address"] for g in on_host if g["address"] in given)

    return gpus


def guest_report(gpus: int, fault: GuestFault | None = None) -> dict:
    """The report a guest with `gpus` passed through writes, in the image script's own shape; guest-side
    addresses as QEMU's q35 machine numbers them (the captured guest had its one H200 at 00:06.0)."""
    fault = fault or GuestFault()
    seen = max(gpus - fault.missing_gpus, 0)
    pci = [{"address": f"0000:00:{6 + i:02x}.0", "device": "0x2335", "driver": "nvidia"} for i in range(seen)]
    if fault.driver == "absent":
        return gpu_report.build_report(
            [{**g, "driver": None} for g in pci],
            {"state": "absent", "version": None, "detail": "nvidia-smi is not installed"},
            None,
        )
    if fault.driver == "failed":
        detail = "nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
        return gpu_report.build_report(pci, {"state": "failed", "version": None, "detail": detail}, None)
    smi = [{"bus_id": "0000" + g["address"].upper(), "name": "NVIDIA H200", "uuid": None} for g in pci]
    return gpu_report.build_report(pci, {"state": "loaded", "version": SIM_DRIVER_VERSION, "detail": None}, smi)


class SimulatedDhcpAndGuest:
    def __init__(
        self,
        hostsdir: str | os.PathLike[str],
        lease_file: str | os.PathLike[str],
        ssh_port: int,
        *,
        poll_interval_s: float = 0.1,
        gpus_of: GpusOf | None = None,
    ) -> None:
        """`gpus_of`: the GPUs each VM was given; without it every guest sees none (a lab host's slots)."""
        self.hostsdir = Path(hostsdir)
        self.lease_file = Path(lease_file)
        self.ssh_port = ssh_port
        self.poll_interval_s = poll_interval_s
        self._leases: dict[str, tuple[Reservation, int]] = {}  # by MAC: reservation, expiry
        self._names: dict[str, str] = {}  # by IP: the reservation's (the VM's) name
        self.gpus_of = gpus_of
        self.faults: dict[str, GuestFault] = {}  # by VM name
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
        by_name = await asyncio.to_thread(read_reservations, self.hostsdir)
        wanted = {r.mac: r for r in by_name.values()}
        self._names = {r.ip: name for name, r in by_name.items()}
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

    async def login(self, ip: str) -> LoginOutcome:
        """The agent's readiness login to the guest at `ip`: cloud-init is done at once, and the guest's GPU
        report is what its domain was given, less its fault."""
        name = self._names.get(ip)
        if name is None or ip not in self._servers:
            return LoginOutcome(False, detail=f"ssh: connect to host {ip}: no simulated guest")
        fault = self.faults.get(name)
        if fault is not None and fault.no_report:
            return LoginOutcome(False, report_missing=True, detail="logged in, cloud-init done; no GPU report")
        gpus = await self.gpus_of(name) if self.gpus_of else []
        return LoginOutcome(True, gpu_report=json.dumps(guest_report(len(gpus), fault), sort_keys=True))

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
