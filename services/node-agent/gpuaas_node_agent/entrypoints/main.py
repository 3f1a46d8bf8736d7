"""`gpuaas-node-agent`: one agent per host, or a whole simulated fleet in one process."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from gpuaas_common.bus import PermanentError
from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.fleet import Fleet, FleetNode
from gpuaas_common.jetstream import node_agent_consumer
from gpuaas_common.logging import get_logger
from gpuaas_common.runtime import ServiceRuntime, run_service

from ..adapters.fixture_host import build_host_root, describe_fleet_node
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


def build_register(settings: AgentSettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.bus is not None
        bus = rt.bus
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
        enrolments: list[m.NodeEnrolled] = []
        for node in nodes:
            if node.kind == "baremetal":
                if settings.fleet_file and settings.maas_sim_url and node.maas_system_id:
                    rt.spawn(_sim_baremetal(rt, node, settings.maas_sim_url).run(), f"sim-bm-{node.node_id}")
                continue
            if settings.sim_instant_hosts:
                if not settings.fleet_file:
                    raise SystemExit("GPUAAS_SIM_INSTANT_HOSTS is only for a simulated fleet (GPUAAS_FLEET_FILE)")
                instant = InstantSliceHost(node.node_id, bus.publish)
                bus.subscribe(
                    node_agent_consumer(node.node_id, max_deliver=settings.consumer_max_deliver),
                    {"slice.vm_provision": instant.on_task, "slice.vm_release": instant.on_task},
                    transactional=False, concurrency=settings.task_concurrency,
                )
                enrolments.append(m.NodeEnrolled(node_id=node.node_id, kind="slice_host", hostname=node.hostname,
                                                 agent_version=AGENT_VERSION))
                continue
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
            bus.subscribe(
                node_agent_consumer(node.node_id, max_deliver=settings.consumer_max_deliver,
                                    ack_wait_s=settings.task_ack_wait_s),
                handlers, transactional=False, concurrency=settings.task_concurrency,
            )
            rt.spawn(_start_agent(agent), f"start-{node.node_id}")
            enrolments.append(m.NodeEnrolled(node_id=node.node_id, kind="slice_host", hostname=node.hostname,
                                             agent_version=AGENT_VERSION))

        async def enrol_all() -> None:
            for ev in enrolments:
                await bus.publish("node.enrolled", ev, correlation_id=ev.node_id, node_id=ev.node_id)

        rt.spawn(enrol_all(), "enrol")

    return register


async def _start_agent(agent: SliceHostAgent) -> None:
    # Recovery first: a task the previous run left half-done gets its one result before new evidence goes out.
    await agent.recover()
    await agent.report_host_state()


def _sim_baremetal(rt: ServiceRuntime, node: FleetNode, maas_sim_url: str) -> SimulatedBaremetalHost:
    assert node.maas_system_id is not None

    async def enrol(env: dict[str, str]) -> None:
        token = env.get("GPUAAS_ENROLMENT_TOKEN")
        allocation_id = env.get("GPUAAS_ALLOCATION_ID")
        if not token or not allocation_id:
            raise PermanentError("schema_invalid", "user_data carries no enrolment token")
        ev = m.NodeEnrolled(
            node_id=node.node_id, kind="baremetal", hostname=node.hostname, agent_version=AGENT_VERSION,
            maas_system_id=node.maas_system_id, allocation_id=allocation_id, enrolment_proof=enrolment_proof(token),
        )
        assert rt.bus is not None
        await rt.bus.publish("node.enrolled", ev, correlation_id=allocation_id, node_id=node.node_id,
                             event_id=derived_event_id(allocation_id, f"enrolled:{node.node_id}"))

    return SimulatedBaremetalHost(node.node_id, node.maas_system_id, maas_sim_url, enrol)


def serve() -> None:
    settings = AgentSettings()
    run_service("node-agent", settings, build_register(settings))


def main() -> None:
    if len(sys.argv) > 1:
        from .cli import app

        app()
        return
    serve()


if __name__ == "__main__":
    main()
