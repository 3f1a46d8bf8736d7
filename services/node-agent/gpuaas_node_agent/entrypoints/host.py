"""Wiring of one slice host's agent onto its own bus link.

The production entrypoint runs it once, for the host it is on; the dev fleet runner (`gpuaas-sim-fleet`)
runs it once per simulated host, so a simulated host runs exactly the code a real one does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nats.errors

from gpuaas_common.bus import Bus, parse_message
from gpuaas_common.contract import Envelope, TaskType, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import ConsumerSpec, node_agent_consumer, provision
from gpuaas_common.logging import get_logger

from ..adapters.guest_ssh import agent_login_key, relay_key
from ..adapters.host import HostFs
from ..adapters.host_link import HostLink
from ..adapters.hypervisor import choose_domain_type
from ..adapters.libvirt_host import LibvirtHost
from ..adapters.node_env import node_env_present
from ..adapters.state_store import StateStore
from ..domain.baremetal import choose_role
from ..domain.task_routing import misrouted_task
from ..service_layer.host_paths import HostPaths
from ..service_layer.prewarm import ImagePrewarmer
from ..service_layer.tasks import SliceHostAgent
from ..service_layer.tasks.context import GuestLogin
from ..service_layer.terminal import Ask, TerminalRelay
from ..settings import AgentSettings, parse_path_map

AGENT_VERSION = "0.1.0"
log = get_logger(__name__)


async def open_host_bus(settings: AgentSettings, node_id: str, link: HostLink) -> tuple[Bus, ConsumerSpec]:
    bus = await link.open()
    spec = node_agent_consumer(node_id, max_deliver=settings.consumer_max_deliver, ack_wait_s=settings.task_ack_wait_s)
    if not link.identity.creds_file:
        await provision(bus.js, [spec])  # an open dev server only; a host identity may not provision
    return bus, spec


def slice_host_enrolment(node_id: str, hostname: str) -> m.NodeEnrolled:
    return m.NodeEnrolled(node_id=node_id, kind="slice_host", hostname=hostname, agent_version=AGENT_VERSION)


def refuse_a_deployed_host(root: Path) -> None:
    """RoleRefused where a deploy made this host a baremetal tenant's (its cloud-init env file is under the
    root): such a host never runs the slice role nor announces itself as a slice host, whoever runs this (the
    entrypoint refuses the role at start already; the simulated fleet and tests call run_slice_host directly).
    The image pipeline refuses such an enrolment too, since a tenant with root can publish one by hand."""
    choose_role("slice_host", node_env_present(root))


def terminal_relay(
    settings: AgentSettings, node_id: str, paths: HostPaths, store: StateStore, key: Path, ssh_port: int, bus: Bus
) -> TerminalRelay:
    """The slice terminal of this host: the relay key's sessions into its guests, relayed over its bus link."""
    return TerminalRelay(
        node_id, store, paths.host(settings.seed_dir), key, settings.console_user, ssh_port, bus_ask(bus, node_id)
    )


def bus_ask(bus: Bus, node_id: str) -> Ask:
    """A request on one of this host's own subjects, answered on its inbox; both ways checked by the contract.
    No answer in time is a TimeoutError."""

    async def ask(type_: str, payload: m.Payload, timeout_s: float) -> Any:
        spec = spec_for(type_)
        env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="node-agent", correlation_id=node_id)
        assert bus.nc is not None
        try:
            msg = await bus.nc.request(spec.subject(node_id=node_id), env.model_dump_json().encode(), timeout=timeout_s)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            raise TimeoutError(f"{type_}: no answer in {timeout_s:.0f}s") from None
        reply_env, reply = parse_message(msg.subject, msg.data)
        if reply_env.type != spec.reply:
            raise TimeoutError(f"{type_} answered with {reply_env.type}")
        return reply

    return ask


async def run_slice_host(
    settings: AgentSettings,
    node_id: str,
    hostname: str,
    root: Path,
    ssh_port: int,
    link: HostLink,
    *,
    bridge_cidr: str | None = None,
    libvirt: LibvirtHost | None = None,
    guest_login: GuestLogin | None = None,
) -> None:
    """`libvirt`: the hypervisor connection to use; the simulated fleet passes its own so that it can read
    the domains of a private test hypervisor, which no second connection sees. `guest_login`: the simulated
    fleet's guests, which are no machines to log in to, answer the readiness login themselves."""
    refuse_a_deployed_host(root)
    bus, spec = await open_host_bus(settings, node_id, link)
    paths = HostPaths(root, parse_path_map(settings.host_path_map))
    store = StateStore(paths.host(settings.state_dir) / "agent.sqlite")
    domain_type, why = choose_domain_type(settings.domain_type, HostFs(root))
    log.info("domain_type_chosen", node_id=node_id, domain_type=domain_type, setting=settings.domain_type, reason=why)
    readiness_key = await agent_login_key(paths.host(settings.state_dir)) if settings.readiness_login else None
    # Made at the first start and injected into every guest's seed: the slice terminal logs in with it.
    relay = await relay_key(paths.host(settings.state_dir))
    agent = SliceHostAgent(
        node_id,
        paths,
        store,
        libvirt or LibvirtHost(settings.libvirt_uri),
        bus.publish,
        hostsdir=settings.dnsmasq_hostsdir,
        lease_file=settings.dnsmasq_lease_file,
        seed_dir=settings.seed_dir,
        ssh_port=ssh_port,
        readiness_timeout_s=settings.readiness_timeout_s,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        bridge_cidr=bridge_cidr or settings.gpu_bridge_cidr,
        domain_type=domain_type,
        bridge_kind=settings.bridge_kind,
        guest_user=settings.guest_user,
        console_user=settings.console_user,
        readiness_key=readiness_key,
        guest_login=guest_login,
        relay_public_key=relay[1],
        held_dead_letters=bus.held_dead_letters,
        gpu_bridge=settings.gpu_bridge,
        emulated_slot_disks=tuple(settings.emulated_slot_disks),
        require_bf3_management=settings.parity_require_bf3_management,
    )
    if settings.emulated_slot_disks:
        log.info("emulated_slots", node_id=node_id, disks=list(settings.emulated_slot_disks))
    handlers = {
        TaskType.SLICE_VM_PROVISION: agent.on_task,
        TaskType.SLICE_VM_RELEASE: agent.on_task,
        TaskType.SLICE_TOPOLOGY_DISCOVER: agent.on_discover,
        TaskType.SLICE_PARITY_CHECK: agent.on_parity_check,
        TaskType.SLICE_VFIO_APPLY: agent.on_vfio_apply,
        TaskType.SLICE_SLOT_WIPE: agent.on_slot_wipe,
        TaskType.SLICE_TERMINAL_OPEN: terminal_relay(settings, node_id, paths, store, relay[0], ssh_port, bus).on_open,
    }
    handlers[TaskType.IMAGE_CACHE_PREWARM] = ImagePrewarmer(
        node_id, paths, store, bus.publish, image_cache_dir=settings.image_cache_dir
    ).on_task
    # A task refused for its subject (domain/task_routing.py) is terminated, logged and counted, never dead-lettered
    # and never answered with a task result: its sender may not send that type, so nobody is waiting for one.
    bus.subscribe(
        spec,
        handlers,
        transactional=False,
        concurrency=settings.task_concurrency,
        refuse=lambda subject, body: misrouted_task(node_id, subject, body),
    )
    # Recovery first: a task the previous run left half-done gets its one result before new evidence goes out.
    await agent.recover()
    await link.start()
    await agent.report_host_state()
    refuse_a_deployed_host(root)  # again as it announces: the root is checked when it matters
    await bus.publish("node.enrolled", slice_host_enrolment(node_id, hostname), correlation_id=node_id, node_id=node_id)
    # The start-up pass (in recover) swept before new work came in; from here the reconciler reports drift,
    # now and every interval, for as long as the host runs.
    await agent.reconcile_periodically(settings.reconcile_interval_s)
