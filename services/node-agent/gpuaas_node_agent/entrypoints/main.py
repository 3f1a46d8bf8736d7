"""`gpuaas-node-agent`: one agent per host, or a whole simulated fleet in one process."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

from gpuaas_common.bus import PermanentError
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.fleet import Fleet, FleetNode
from gpuaas_common.identity.creds import write_secret
from gpuaas_common.identity.permissions import node_user_name
from gpuaas_common.jetstream import node_agent_consumer, provision
from gpuaas_common.logging import get_logger
from gpuaas_common.natsconn import NatsIdentity, split_servers
from gpuaas_common.runtime import ServiceRuntime, run_service

from ..adapters.fixture_host import build_host_root, describe_fleet_node
from ..adapters.host_link import HostLink
from ..adapters.libvirt_host import LibvirtHost
from ..adapters.sim_instant import InstantSliceHost
from ..adapters.sim_baremetal import SimulatedBaremetalHost, enrolment_proof
from ..adapters.sim_host import SimulatedDhcpAndGuest
from ..adapters.state_store import StateStore
from ..service_layer.host_paths import HostPaths
from ..service_layer.prewarm import ImagePrewarmer
from ..service_layer.tasks import SliceHostAgent
from ..settings import AgentSettings

log = get_logger(__name__)
AGENT_VERSION = "0.1.0"


def _prepare_sim_host(settings: AgentSettings, node: FleetNode, paths: HostPaths) -> None:
    """Give a simulated slice host a generated host tree (sysfs, /dev with its disks, /proc, /etc and host
    tools, so discovery, parity and the disk preflight work on it), its image cache and dnsmasq directories."""
    build_host_root(paths.root, describe_fleet_node(node, disk_file_bytes=settings.sim_disk_size_mib * 1024 * 1024))
    cache = paths.host(settings.image_cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if settings.sim_image_dir:
        for image in Path(settings.sim_image_dir).glob("*.raw"):
            target = cache / image.name
            if not target.exists():
                shutil.copyfile(image, target)
    paths.host(settings.dnsmasq_hostsdir).mkdir(parents=True, exist_ok=True)
    paths.host(settings.dnsmasq_lease_file).parent.mkdir(parents=True, exist_ok=True)
    paths.host(settings.seed_dir).mkdir(parents=True, exist_ok=True)


def _host_identity(settings: AgentSettings, node_id: str) -> NatsIdentity:
    """Each host connects as its own user: `GPUAAS_NATS_CREDS` on a real host, or
    `<GPUAAS_NATS_CREDS_DIR>/node-<node_id>.creds` for every host of a simulated fleet."""
    servers = split_servers(settings.nats_url)
    if settings.nats_creds_dir:
        return NatsIdentity(servers, str(Path(settings.nats_creds_dir) / f"{node_user_name(node_id)}.creds"),
                            settings.nats_ca_file)
    return NatsIdentity(servers, settings.nats_creds, settings.nats_ca_file)


def build_register(settings: AgentSettings):
    async def register(rt: ServiceRuntime) -> None:
        if settings.fleet_file:
            fleet = Fleet.load(settings.fleet_file)
            nodes = fleet.nodes
            ssh_port = fleet.ssh_port
        else:
            if not settings.node_id:
                raise SystemExit("set GPUAAS_NODE_ID (one host) or GPUAAS_FLEET_FILE (simulated fleet)")
            nodes = [FleetNode(node_id=settings.node_id, kind="slice_host", hostname=os.uname().nodename,
                               sku="h200-sxm-slice", host_root=settings.host_root)]
            ssh_port = settings.ssh_port
        links: dict[str, HostLink] = {}
        for node in nodes:
            if node.kind == "baremetal":
                if settings.fleet_file and settings.maas_sim_url and node.maas_system_id:
                    rt.spawn(_sim_baremetal(settings, node, settings.maas_sim_url).run(), f"sim-bm-{node.node_id}")
                continue
            link = links[node.node_id] = HostLink(node.node_id, _host_identity(settings, node.node_id),
                                                  retry_delays_s=settings.retry_delays_s)
            rt.spawn(_run_slice_host(settings, node, ssh_port, link), f"host-{node.node_id}")
        # Ready once every slice host has its own link up; a host that cannot connect keeps the
        # process unready and says why in the log, the other hosts work on.
        rt.health.checks["hosts"] = lambda: all(link.bus is not None for link in links.values())

        async def close_links() -> None:
            await asyncio.gather(*(link.close() for link in links.values()), return_exceptions=True)

        rt.on_stop.append(close_links)

    return register


async def _run_slice_host(settings: AgentSettings, node: FleetNode, ssh_port: int, link: HostLink) -> None:
    bus = await link.open()
    spec = node_agent_consumer(node.node_id, max_deliver=settings.consumer_max_deliver,
                               ack_wait_s=settings.task_ack_wait_s)
    if not link.identity.creds_file:
        await provision(bus.js, [spec])  # an open dev server only; a host identity may not provision
    enrolment = m.NodeEnrolled(node_id=node.node_id, kind="slice_host", hostname=node.hostname,
                               agent_version=AGENT_VERSION)
    if settings.sim_instant_hosts:
        if not settings.fleet_file:
            raise SystemExit("GPUAAS_SIM_INSTANT_HOSTS is only for a simulated fleet (GPUAAS_FLEET_FILE)")
        instant = InstantSliceHost(node.node_id, bus.publish)
        bus.subscribe(spec, {"slice.vm_provision": instant.on_task, "slice.vm_release": instant.on_task},
                      transactional=False, concurrency=settings.task_concurrency)
        await link.start()
        await bus.publish("node.enrolled", enrolment, correlation_id=node.node_id, node_id=node.node_id)
        return
    paths = HostPaths(Path(node.host_root or settings.host_root))
    if settings.fleet_file:
        _prepare_sim_host(settings, node, paths)
        sim = SimulatedDhcpAndGuest(paths.host(settings.dnsmasq_hostsdir),
                                    paths.host(settings.dnsmasq_lease_file), ssh_port)
        await sim.start()
    store = StateStore(paths.host(settings.state_dir) / "agent.sqlite")
    agent = SliceHostAgent(
        node.node_id, paths, store, LibvirtHost(settings.libvirt_uri), bus.publish,
        image_cache_dir=settings.image_cache_dir, hostsdir=settings.dnsmasq_hostsdir,
        lease_file=settings.dnsmasq_lease_file, seed_dir=settings.seed_dir, ssh_port=ssh_port,
        readiness_timeout_s=settings.readiness_timeout_s, shutdown_timeout_s=settings.shutdown_timeout_s,
    )
    handlers = {"slice.vm_provision": agent.on_task, "slice.vm_release": agent.on_task,
                "slice.topology_discover": agent.on_discover}
    handlers["image.cache_prewarm"] = ImagePrewarmer(
        node.node_id, paths, store, bus.publish, image_cache_dir=settings.image_cache_dir).on_task
    bus.subscribe(spec, handlers, transactional=False, concurrency=settings.task_concurrency)
    # Recovery first: a task the previous run left half-done gets its one result before new evidence goes out.
    await agent.recover()
    await link.start()
    await agent.report_host_state()
    await bus.publish("node.enrolled", enrolment, correlation_id=node.node_id, node_id=node.node_id)


def _sim_baremetal(settings: AgentSettings, node: FleetNode, maas_sim_url: str) -> SimulatedBaremetalHost:
    """A simulated baremetal host connects only with the credentials its deploy user-data carried, as a
    real host would, and drops them when MAAS takes the machine back."""
    assert node.maas_system_id is not None
    root = Path(node.host_root) if node.host_root else Path(settings.state_dir) / "baremetal" / node.node_id
    link: HostLink | None = None

    async def enrol(env: dict[str, str], creds_text: str | None) -> None:
        nonlocal link
        token = env.get("GPUAAS_ENROLMENT_TOKEN")
        allocation_id = env.get("GPUAAS_ALLOCATION_ID")
        if not token or not allocation_id:
            raise PermanentError("schema_invalid", "user_data carries no enrolment token")
        await leave()
        creds_file = None
        if creds_text:
            creds_file = str(write_secret(root / "etc" / "gpuaas" / "node.creds", creds_text))
        elif settings.nats_creds_dir:
            raise PermanentError("no_credentials", "user_data carries no NATS credentials for this host")
        link = HostLink(node.node_id, NatsIdentity(split_servers(settings.nats_url), creds_file,
                                                   settings.nats_ca_file), retry_delays_s=settings.retry_delays_s)
        bus = await link.open(retry_forever=False)
        ev = m.NodeEnrolled(
            node_id=node.node_id, kind="baremetal", hostname=node.hostname, agent_version=AGENT_VERSION,
            maas_system_id=node.maas_system_id, allocation_id=allocation_id, enrolment_proof=enrolment_proof(token),
        )
        await bus.publish("node.enrolled", ev, correlation_id=allocation_id, node_id=node.node_id,
                          event_id=derived_event_id(allocation_id, f"enrolled:{node.node_id}"))

    async def leave() -> None:
        nonlocal link
        if link is not None:
            await link.close()
            link = None

    return SimulatedBaremetalHost(node.node_id, node.maas_system_id, maas_sim_url, enrol, leave)


def serve() -> None:
    settings = AgentSettings()
    run_service("node-agent", settings, build_register(settings), connect_bus=False)


def main() -> None:
    if len(sys.argv) > 1:
        from .cli import app

        app()
        return
    serve()


if __name__ == "__main__":
    main()
