"""`gpuaas-node-agent`: the agent of the one host it runs on, connected as that host's own NATS user: a slice
host's (`GPUAAS_NODE_ID`, `GPUAAS_NATS_CREDS`), or on a baremetal host the allocation-bound one its deploy's
cloud-init wrote (`GPUAAS_ROLE`, entrypoints/baremetal.py). The simulated dev fleet is `gpuaas-sim-fleet`
(gpuaas_dev.sim)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gpuaas_common.natsconn import NatsIdentity
from gpuaas_common.runtime import ServiceRuntime, run_service
from gpuaas_common.startup import StartupFailed

from ..adapters.host_link import HostLink
from ..settings import AgentSettings
from .baremetal import baremetal_identity, baremetal_link, host_role, run_baremetal_host
from .host import run_slice_host


def build_baremetal_register(settings: AgentSettings):
    identity = baremetal_identity(settings)

    async def register(rt: ServiceRuntime) -> None:
        link = baremetal_link(settings, identity)
        rt.spawn(run_baremetal_host(settings, identity, os.uname().nodename, link), f"baremetal-{identity.node_id}")
        rt.health.checks["host"] = lambda: link.bus is not None
        rt.on_stop.append(link.close)

    return register


def build_register(settings: AgentSettings):
    if host_role(settings) == "baremetal":
        return build_baremetal_register(settings)
    node_id = settings.node_id
    if not node_id:
        raise StartupFailed(
            "invalid_settings",
            "GPUAAS_NODE_ID is not set: the id of the host this agent runs on",
            setting="GPUAAS_NODE_ID",
        )

    async def register(rt: ServiceRuntime) -> None:
        link = HostLink(node_id, NatsIdentity.from_settings(settings), retry_delays_s=settings.retry_delays_s)
        rt.spawn(
            run_slice_host(settings, node_id, os.uname().nodename, Path(settings.host_root), settings.ssh_port, link),
            f"host-{node_id}",
        )
        # A host that cannot connect keeps the process unready and says why in the log.
        rt.health.checks["host"] = lambda: link.bus is not None
        rt.on_stop.append(link.close)

    return register


def serve() -> None:
    run_service("node-agent", AgentSettings, build_register, connect_bus=False)


def main() -> None:
    if len(sys.argv) > 1:
        from .cli import app

        app()
        return
    serve()


if __name__ == "__main__":
    main()
