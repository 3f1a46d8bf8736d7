"""Wiring of a baremetal host's agent: the tenant's machine, enrolled with the allocation-bound identity its
deploy's cloud-init wrote. It runs no slice tasks (a tenant's root machine has no task durable and may read
none): it opens its link, enrols, and keeps the link for the host's reports until it is stopped.

The production entrypoint runs it for the host it is on; the simulated fleet runs it on a simulated host's
root once it has written the files the deploy's user-data carries, so the simulation has no enrolment of
its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuaas_common.natsconn import NatsIdentity, split_servers
from gpuaas_common.startup import StartupFailed

from ..adapters.host_link import HostLink
from ..adapters.node_env import creds_file, host_uptime, node_env_present, read_node_env
from ..domain.baremetal import BaremetalIdentity, NodeEnvInvalid, Role, RoleRefused, choose_role
from ..service_layer.baremetal import BaremetalHostAgent
from ..settings import AgentSettings
from .host import AGENT_VERSION


def host_role(settings: AgentSettings) -> Role:
    try:
        return choose_role(settings.role, node_env_present(Path(settings.host_root)))
    except RoleRefused as exc:
        raise StartupFailed("invalid_settings", str(exc), setting="GPUAAS_ROLE") from None


def baremetal_identity(settings: AgentSettings) -> BaremetalIdentity:
    """The host's identity from cloud-init's files; a missing or garbled file is a one-line start-up failure."""
    try:
        identity = read_node_env(Path(settings.host_root))
    except NodeEnvInvalid as exc:
        raise StartupFailed("invalid_settings", str(exc), setting="GPUAAS_ROLE") from None
    if settings.node_id and settings.node_id != identity.node_id:
        raise StartupFailed(
            "invalid_settings",
            "GPUAAS_NODE_ID differs from the node id the deploy wrote into /etc/gpuaas/node-agent.env",
            setting="GPUAAS_NODE_ID",
        )
    return identity


def baremetal_link(settings: AgentSettings, identity: BaremetalIdentity) -> HostLink:
    """Connects as the allocation's host user when the deploy carried creds; otherwise as GPUAAS_NATS_CREDS
    names (an open dev server only: an operator-mode server refuses a baremetal host any other identity)."""
    creds = creds_file(Path(settings.host_root), identity) or settings.nats_creds
    nats = NatsIdentity(
        split_servers(settings.nats_url), creds, settings.nats_ca_file, insecure_dev=settings.nats_insecure_dev
    )
    return HostLink(identity.node_id, nats, retry_delays_s=settings.retry_delays_s)


async def run_baremetal_host(
    settings: AgentSettings, identity: BaremetalIdentity, hostname: str, link: HostLink
) -> None:
    """Enrols, then holds the link until cancelled. Nothing is subscribed: no slice task can reach it."""
    boot_seconds = host_uptime(Path(settings.host_root))
    bus = await link.open()
    agent = BaremetalHostAgent(
        identity,
        hostname,
        AGENT_VERSION,
        bus.publish,
        announce_again_s=settings.enrolment_announce_again_s,
        announce_for_s=settings.enrolment_announce_for_s,
        boot_seconds=boot_seconds,
    )
    await agent.run()
    await asyncio.Event().wait()
