"""An SSH banner on the expected address is not readiness: without the DHCP lease of the VM's MAC, the
answer may come from anything else holding that IP (a stale guest, another tenant's VM, a host service)."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

from gpuaas_node_agent.adapters.readiness import probe_ssh_banner, wait_ready


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_ssh_answering_without_a_lease_is_not_ready(tmp_path: Path) -> None:
    ip, port, mac = f"127.101.{random.randint(1, 254)}.{random.randint(2, 254)}", _free_port(), "52:54:00:bb:00:01"

    async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-impostor\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(banner, ip, port)
    try:
        assert await probe_ssh_banner(ip, port, 1.0), "the impostor must really answer, or this proves nothing"
        leases = tmp_path / "dnsmasq.leases"
        leases.write_text(f"0 52:54:00:bb:00:99 {ip} someone-else *\n")  # a lease, but for another MAC
        ready = await wait_ready(
            str(leases), mac, ip, port, deadline_s=0.5, poll_interval_s=0.05, connect_timeout_s=0.2
        )
    finally:
        server.close()
        await server.wait_closed()
    assert (ready.lease_state, ready.ssh_ready) == ("absent", False)
