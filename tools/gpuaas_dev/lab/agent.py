"""The production `gpuaas-node-agent`, run as the lab host's agent inside the lab's namespace.

It is the binary a GPU host runs, with the settings a lab host needs and nothing simulated: the real root
filesystem, the lab's libvirt daemon, QEMU/TCG chosen by its own probe, the lab bridge (a Linux bridge, not
OVS), the lab's dnsmasq files, and NATS at the same loopback URL as outside (the lab forwards it).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .lab import Lab

# Agent-owned directories, at their runbook paths under the lab's host prefix (LabState.host_dir): on a host
# they are /var/lib/gpuaas/…; `dev down` removes the lab's prefix with everything in it.
IMAGE_CACHE = "var/lib/gpuaas/slice-images"
STATE = "var/lib/gpuaas/agent"
SEEDS = "var/lib/gpuaas/seeds"


@dataclass
class LabAgentConfig:
    node_id: str
    nats_url: str
    nats_creds: str | None = None
    nats_ca_file: str | None = None
    readiness_timeout_s: float = 420.0
    shutdown_timeout_s: float = 60.0
    extra_env: dict[str, str] = field(default_factory=dict)


def host_prefix(lab: Lab) -> Path:
    assert lab.state is not None
    return Path(lab.state.host_dir)


def image_cache_dir(lab: Lab) -> Path:
    path = host_prefix(lab) / IMAGE_CACHE
    path.mkdir(parents=True, exist_ok=True)
    return path


def agent_env(lab: Lab, cfg: LabAgentConfig) -> dict[str, str]:
    assert lab.state is not None
    prefix = host_prefix(lab)
    for sub in (IMAGE_CACHE, STATE, SEEDS):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    env = {
        "GPUAAS_NODE_ID": cfg.node_id,
        "GPUAAS_NATS_URL": cfg.nats_url,
        "GPUAAS_HOST_ROOT": "/",
        "GPUAAS_LIBVIRT_URI": lab.state.libvirt_uri,
        "GPUAAS_DOMAIN_TYPE": "auto",
        "GPUAAS_BRIDGE_KIND": "linux",
        "GPUAAS_GPU_BRIDGE_CIDR": lab.state.bridge_cidr,
        "GPUAAS_STATE_DIR": str(prefix / STATE),
        "GPUAAS_IMAGE_CACHE_DIR": str(prefix / IMAGE_CACHE),
        "GPUAAS_SEED_DIR": str(prefix / SEEDS),
        "GPUAAS_DNSMASQ_HOSTSDIR": lab.state.hostsdir,
        "GPUAAS_DNSMASQ_LEASE_FILE": lab.state.lease_file,
        "GPUAAS_READINESS_TIMEOUT_S": str(cfg.readiness_timeout_s),
        "GPUAAS_SHUTDOWN_TIMEOUT_S": str(cfg.shutdown_timeout_s),
        "GPUAAS_HEALTH_PORT": "0",
        "GPUAAS_READY_FILE": str(lab.root / f"agent-{cfg.node_id}.ready"),
        **({"GPUAAS_NATS_CREDS": cfg.nats_creds} if cfg.nats_creds else {}),
        **({"GPUAAS_NATS_CA_FILE": cfg.nats_ca_file} if cfg.nats_ca_file else {}),
        **cfg.extra_env,
    }
    return env


def start_agent(lab: Lab, cfg: LabAgentConfig) -> int:
    """Start the agent in the namespace; its pid is recorded in lab.json so `down` stops it."""
    binary = Path(sys.executable).parent / "gpuaas-node-agent"
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
    if "GPUAAS_NATS_INSECURE_DEV" in os.environ:  # a plaintext test bus, named so by whoever runs the lab
        base["GPUAAS_NATS_INSECURE_DEV"] = os.environ["GPUAAS_NATS_INSECURE_DEV"]
    # `env -i` inside `ip netns exec`: the agent gets exactly these variables, no leftover of the caller's.
    argv = lab.ns("env", "-i", *[f"{k}={v}" for k, v in {**base, **agent_env(lab, cfg)}.items()], str(binary))
    return lab.spawn(f"agent-{cfg.node_id}", argv)


def stop_agent(lab: Lab, node_id: str) -> None:
    lab.stop(f"agent-{node_id}")
