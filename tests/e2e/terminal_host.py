"""A slice host's terminal in a process of its own, wired as `run_slice_host` wires it: the host's bus link
(HostLink, its own durable), the relay key made by `relay_key` in its state dir, and `terminal_relay` taking
`slice.terminal_open` tasks. The e2e terminal test runs it beside a private sshd that stands in for the guest;
the host's other roles (libvirt, disks, evidence) take no part in a terminal session, so they are left out.

Settings come from the agent's own environment variables (GPUAAS_NODE_ID, GPUAAS_NATS_URL, GPUAAS_STATE_DIR,
GPUAAS_SEED_DIR, GPUAAS_GUEST_USER, GPUAAS_SSH_PORT); it writes `$TERMINAL_HOST_READY` once it takes tasks.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from gpuaas_common.logging import configure_logging
from gpuaas_common.natsconn import NatsIdentity
from gpuaas_node_agent.adapters.guest_ssh import relay_key
from gpuaas_node_agent.adapters.host_link import HostLink
from gpuaas_node_agent.adapters.state_store import StateStore
from gpuaas_node_agent.entrypoints.host import open_host_bus, terminal_relay
from gpuaas_node_agent.service_layer.host_paths import HostPaths
from gpuaas_node_agent.settings import AgentSettings, parse_path_map


async def main() -> None:
    settings = AgentSettings()
    configure_logging("node-agent", settings.log_level)
    node_id = settings.node_id
    assert node_id, "GPUAAS_NODE_ID"
    link = HostLink(node_id, NatsIdentity.from_settings(settings), retry_delays_s=settings.retry_delays_s)
    bus, spec = await open_host_bus(settings, node_id, link)
    paths = HostPaths(Path(settings.host_root), parse_path_map(settings.host_path_map))
    store = StateStore(paths.host(settings.state_dir) / "agent.sqlite")
    key, _public = await relay_key(paths.host(settings.state_dir))
    relay = terminal_relay(settings, node_id, paths, store, key, settings.ssh_port, bus)
    bus.subscribe(spec, {"slice.terminal_open": relay.on_open}, transactional=False)
    await link.start()
    await asyncio.to_thread(Path(os.environ["TERMINAL_HOST_READY"]).write_text, "ready\n")
    try:
        await asyncio.Event().wait()
    finally:
        await relay.stop()


if __name__ == "__main__":
    asyncio.run(main())
