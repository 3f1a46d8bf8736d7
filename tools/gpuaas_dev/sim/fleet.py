"""`gpuaas-sim-fleet`: every host of a fleet file in one process, each as its own NATS user.

Slice hosts run the production agent wiring (gpuaas_node_agent.entrypoints.host) on a generated host tree
with simulated DHCP and guests (which answer the agent's readiness login with the GPUs their domain was given),
or answer at once (`GPUAAS_SIM_INSTANT_HOSTS`, benchmarks only). Baremetal
hosts boot when the MAAS simulator says Deployed and connect only with the creds their user-data carried.

A slice host that is a MAAS machine can be deployed to a baremetal tenant too (once ops converted it): MAAS
replaces its OS, so its slice agent stops and the host enrols as a baremetal host with the deploy's
credentials. Back from the tenant it waits, with no agent, until the scheduler's host walk redeploys it with
the slice-host profile: that deploy's user-data carries no tenant's enrolment file but the host's new creds,
which the host writes where its slice agent reads them, and the slice agent starts again on the same host
tree, reporting its topology and parity like any freshly bootstrapped host.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import xml.etree.ElementTree as ET  # noqa: S405 - our own libvirt's XML
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from gpuaas_common.contract import TaskType
from gpuaas_common.fleet import Fleet, FleetNode
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import node_user_name
from gpuaas_common.logging import get_logger
from gpuaas_common.natsconn import NatsIdentity, split_servers
from gpuaas_common.runtime import ServiceRuntime, run_service
from gpuaas_common.startup import StartupFailed
from gpuaas_node_agent.adapters.host_link import HostLink
from gpuaas_node_agent.adapters.libvirt_host import LibvirtHost
from gpuaas_node_agent.adapters.node_env import node_env_present
from gpuaas_node_agent.entrypoints.baremetal import baremetal_identity, baremetal_link, run_baremetal_host
from gpuaas_node_agent.entrypoints.host import open_host_bus, run_slice_host, slice_host_enrolment
from gpuaas_node_agent.service_layer.host_paths import HostPaths

from .baremetal import SimulatedBaremetalHost, UserDataRefused, fresh_root, write_cloud_init_files
from .dhcp_guest import SimulatedDhcpAndGuest, passed_through_gpus
from .fixture_host import build_host_root, describe_fleet_node, fleet_bridge_cidr
from .instant import InstantSliceHost
from .settings import SimFleetSettings

log = get_logger(__name__)
# Where a slice-host deploy's user-data puts the host's creds (the gateway's cloud_init.NODE_CREDS_PATH).
NODE_CREDS_PATH = "/etc/gpuaas/node.creds"


def _host_identity(settings: SimFleetSettings, node_id: str) -> NatsIdentity:
    servers, insecure = split_servers(settings.nats_url), settings.nats_insecure_dev
    if settings.nats_creds_dir:
        return NatsIdentity(
            servers,
            str(Path(settings.nats_creds_dir) / f"{node_user_name(node_id)}.creds"),
            settings.nats_ca_file,
            insecure_dev=insecure,
            creds_check_interval_s=settings.nats_creds_check_interval_s,
        )
    return NatsIdentity.from_settings(settings)


SHARED_TEST_HYPERVISOR = "test:///default"


def _private_test_hypervisor(paths: HostPaths) -> str:
    """`test:///default` is one hypervisor per process, shared by every host simulated here, with a `test`
    domain of its own: each host's reconciler would report the others' VMs as domains it does not manage.
    A test driver opened from a file is private to its connection: one empty hypervisor per host."""
    node_xml = paths.host("/var/lib/gpuaas/sim-hypervisor.xml")
    node_xml.parent.mkdir(parents=True, exist_ok=True)
    node_xml.write_text("<node>\n</node>\n")
    return f"test://{node_xml.resolve()}"


def _prepare_host_tree(settings: SimFleetSettings, node: FleetNode, paths: HostPaths) -> None:
    """A generated host tree (sysfs, /dev with its disks, /proc, /etc and host tools, so discovery, parity
    and the disk preflight work on it), its image cache and dnsmasq directories."""
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


def build_register(settings: SimFleetSettings):
    async def register(rt: ServiceRuntime) -> None:
        fleet = Fleet.load(settings.fleet_file)
        links: dict[str, HostLink] = {}
        sims: list[SimulatedDhcpAndGuest] = []
        hosts: list[_SimulatedSliceHost] = []
        for node in fleet.nodes:
            if not node.simulated:
                continue  # a real host (the lab's): its own agent runs
            if node.kind == "baremetal":
                if settings.maas_sim_url and node.maas_system_id:
                    rt.spawn(_baremetal_host(settings, node, settings.maas_sim_url).run(), f"sim-bm-{node.node_id}")
                continue
            link = links[node.node_id] = HostLink(
                node.node_id, _host_identity(settings, node.node_id), retry_delays_s=settings.retry_delays_s
            )
            if settings.sim_instant_hosts:
                rt.spawn(_run_instant_host(settings, node, link), f"host-{node.node_id}")
                continue
            host = _SimulatedSliceHost(settings, node, fleet.ssh_port, link)
            sims.append(host.dhcp)
            hosts.append(host)
            rt.spawn(host.first_boot(), f"host-{node.node_id}")
            if settings.maas_sim_url and node.maas_system_id:
                bm = _baremetal_host(
                    settings, node, settings.maas_sim_url, handed_over=host.shut_down, returned=host.boot
                )
                rt.spawn(bm.run(), f"sim-bm-{node.node_id}")
        # Ready once every slice host has its own link up; a host that cannot connect keeps the
        # process unready and says why in the log, the other hosts work on.
        rt.health.checks["hosts"] = lambda: all(link.bus is not None for link in links.values())
        observer = await _start_observer(hosts)
        rt.ready_info["sim_port"] = observer.addresses[0][1]

        async def close() -> None:
            await asyncio.gather(*(host.shut_down() for host in hosts), return_exceptions=True)
            await asyncio.gather(*(link.close() for link in links.values()), return_exceptions=True)
            await asyncio.gather(*(sim.stop() for sim in sims), return_exceptions=True)
            await observer.cleanup()

        rt.on_stop.append(close)

    return register


class _SimulatedSliceHost:
    """One simulated slice host: its host tree and simulated DHCP/guests (prepared once, kept across
    agent runs), and the production agent on its own link, which `shut_down` stops and `boot` starts again."""

    def __init__(self, settings: SimFleetSettings, node: FleetNode, ssh_port: int, link: HostLink) -> None:
        self.settings, self.node, self.ssh_port, self.link = settings, node, ssh_port, link
        self.paths = HostPaths(Path(node.host_root or settings.host_root))
        self.dhcp = SimulatedDhcpAndGuest(
            self.paths.host(settings.dnsmasq_hostsdir),
            self.paths.host(settings.dnsmasq_lease_file),
            ssh_port,
            gpus_of=self._guest_gpus,
        )
        self._agent: asyncio.Task[None] | None = None
        # This boot's hypervisor connection: a private test hypervisor is seen by no other connection.
        self.libvirt: LibvirtHost | None = None

    async def first_boot(self) -> None:
        _prepare_host_tree(self.settings, self.node, self.paths)
        if self.settings.libvirt_uri == SHARED_TEST_HYPERVISOR:
            self.settings = self.settings.model_copy(update={"libvirt_uri": _private_test_hypervisor(self.paths)})
        await self.dhcp.start()
        await self.boot()

    async def boot(self) -> None:
        """Start the agent (it runs until `shut_down`); returns at once."""
        self.libvirt = LibvirtHost(self.settings.libvirt_uri)
        self._agent = asyncio.create_task(
            run_slice_host(
                self.settings,
                self.node.node_id,
                self.node.hostname,
                self.paths.root,
                self.ssh_port,
                self.link,
                bridge_cidr=fleet_bridge_cidr(self.node),
                libvirt=self.libvirt,
                guest_login=self.dhcp.login,
            ),
            name=f"agent-{self.node.node_id}",
        )
        self._agent.add_done_callback(self._agent_ended)

    async def _guest_gpus(self, vm_name: str) -> list[str]:
        """A guest sees the GPUs its domain on this boot's hypervisor was given."""
        if self.libvirt is None:
            return []
        return await passed_through_gpus(self.libvirt, self.paths.root)(vm_name)

    def _agent_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("sim_slice_agent_failed", node_id=self.node.node_id, error=repr(task.exception()))

    async def observed(self) -> dict[str, Any]:
        """What the host runs right now: its hypervisor's domains and its DHCP reservation files."""
        if self._agent is None or self.libvirt is None:
            return {"agent": False, "domains": [], "reservations": []}
        domains = []
        for d in await self.libvirt.list_domains():
            xml = await self.libvirt.xml(d.name)
            domains.append({"name": d.name, "uuid": d.uuid, "state": d.state.value, **_domain_devices(xml or "")})
        hostsdir = self.paths.host(self.settings.dnsmasq_hostsdir)
        return {
            "agent": not self._agent.done(),
            "domains": domains,
            "reservations": sorted(p.name for p in hostsdir.iterdir()) if hostsdir.is_dir() else [],
        }

    async def shut_down(self) -> None:
        if self._agent is not None:
            self._agent.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._agent
            self._agent = None
        await self.link.close()


def _domain_devices(xml: str) -> dict[str, list[str]]:
    """The host devices a domain holds: PCI functions passed through and the disks it was given."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError:
        return {"pci": [], "disks": []}
    pci = []
    for addr in root.findall("./devices/hostdev/source/address"):
        parts = (int(addr.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function"))
        pci.append("{:04x}:{:02x}:{:02x}.{:x}".format(*parts))
    disks = [src.get("dev") or src.get("file") or "" for src in root.findall("./devices/disk[@device='disk']/source")]
    return {"pci": sorted(pci), "disks": sorted(disks)}


async def _start_observer(hosts: list[_SimulatedSliceHost]) -> web.AppRunner:
    """`GET /sim/hosts` on loopback: each simulated slice host's domains and reservations, for checkers that
    compare what the control plane believes with what the hosts run (the port goes in the ready file)."""

    async def observe(_: web.Request) -> web.Response:
        return web.json_response({host.node.node_id: await host.observed() for host in hosts})

    app = web.Application()
    app.router.add_get("/sim/hosts", observe)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def _run_instant_host(settings: SimFleetSettings, node: FleetNode, link: HostLink) -> None:
    bus, spec = await open_host_bus(settings, node.node_id, link)
    instant = InstantSliceHost(node.node_id, bus.publish)
    bus.subscribe(
        spec,
        {
            TaskType.SLICE_VM_PROVISION: instant.on_task,
            TaskType.SLICE_VM_RELEASE: instant.on_task,
            TaskType.IMAGE_CACHE_PREWARM: instant.on_prewarm,
        },
        transactional=False,
        concurrency=settings.task_concurrency,
    )
    await link.start()
    await instant.report_host_state(node)
    await bus.publish(
        "node.enrolled",
        slice_host_enrolment(node.node_id, node.hostname),
        correlation_id=node.node_id,
        node_id=node.node_id,
    )


def _baremetal_host(
    settings: SimFleetSettings,
    node: FleetNode,
    maas_sim_url: str,
    *,
    handed_over: Callable[[], Awaitable[None]] | None = None,
    returned: Callable[[], Awaitable[None]] | None = None,
) -> SimulatedBaremetalHost:
    """A simulated baremetal machine runs the production agent's baremetal role on a root holding only what
    its deploy's cloud-init wrote, so it connects with nothing but the credentials its user-data carried.
    For a slice host, every deploy first stops its slice agent (`handed_over`); a deploy whose user-data
    wrote no tenant's enrolment file is a slice-host deploy, after which `returned` starts the slice agent again
    with the creds that user-data carried."""
    assert node.maas_system_id is not None
    root = Path(node.host_root) if node.host_root else Path(settings.state_dir) / "baremetal" / node.node_id
    if node.kind == "slice_host":
        root = root / "baremetal"  # the tenant's OS lives apart from the slice host's tree
    # Nothing of the fleet's own identity reaches the tenant's machine.
    host_settings = settings.model_copy(
        update={"host_root": str(root), "role": "baremetal", "node_id": None, "nats_creds": None}
    )
    running: dict[str, Any] = {}

    async def boot(user_data: str) -> None:
        if handed_over is not None:
            await handed_over()
        fresh_root(root)
        try:
            write_cloud_init_files(user_data, root)
            if returned is not None and not node_env_present(root):
                await _slice_host_boot(settings, node, root, returned)
                return
            identity = baremetal_identity(host_settings)
        except (UserDataRefused, StartupFailed) as exc:
            # A machine whose user-data gives its agent nothing to enrol with stays up, enrolled nowhere, as a
            # real one would; the allocation fails at its enrolment deadline.
            log.warning("sim_baremetal_agent_refused", node_id=node.node_id, error=str(exc))
            return
        link = baremetal_link(host_settings, identity)
        task = asyncio.create_task(
            run_baremetal_host(host_settings, identity, node.hostname, link), name=f"sim-bm-agent-{node.node_id}"
        )
        task.add_done_callback(functools.partial(_baremetal_agent_ended, node.node_id))
        running.update(link=link, task=task)

    async def leave() -> None:
        task, link = running.pop("task", None), running.pop("link", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if link is not None:
            await link.close()

    key = settings.maas_sim_api_key.get_secret_value() if settings.maas_sim_api_key else None
    return SimulatedBaremetalHost(
        node.node_id, node.maas_system_id, maas_sim_url, boot, leave, ca_file=settings.maas_sim_ca_file, api_key=key
    )


async def _slice_host_boot(
    settings: SimFleetSettings, node: FleetNode, root: Path, start_agent: Callable[[], Awaitable[None]]
) -> None:
    """What the slice-host profile's first boot does: the agent's unit takes the deploy's creds (cloud-init wrote
    them to NODE_CREDS_PATH), here copied to where the host's link reads its creds at every connect."""
    if settings.nats_creds_dir:
        written = root / NODE_CREDS_PATH.lstrip("/")
        if not written.is_file():
            log.warning("sim_slice_host_without_creds", node_id=node.node_id)
            return
        target = Path(settings.nats_creds_dir) / f"{node_user_name(node.node_id)}.creds"
        creds_files.write_secret(target, written.read_text())
    await start_agent()


def _baremetal_agent_ended(node_id: str, task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("sim_baremetal_agent_failed", node_id=node_id, error=repr(task.exception()))


def main() -> None:
    # fleet_file comes from GPUAAS_FLEET_FILE; run_service reads the settings so a bad one fails legibly.
    run_service("node-agent", SimFleetSettings, build_register, connect_bus=False)


if __name__ == "__main__":
    main()
