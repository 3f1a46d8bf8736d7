"""Open vSwitch port settings the agent owns on the slice bridge.

A slice's port is `protected`: OVS's NORMAL forwarding never passes a frame between two protected ports, so
slices on one host cannot reach each other, while the bridge's own port (the host: gateway, DHCP, metadata)
stays reachable. The setting lives in OVSDB with the port and goes when libvirt removes the port.
"""

from __future__ import annotations

from .host import Host


class OvsError(RuntimeError):
    pass


async def protect_port(host: Host, port: str) -> None:
    res = await host.run.run("ovs-vsctl", "--timeout=10", "set", "Port", port, "protected=true")
    if not res.ok:
        raise OvsError(f"ovs-vsctl set Port {port} protected=true exited with {res.rc}: {res.stderr.strip()[:300]}")
