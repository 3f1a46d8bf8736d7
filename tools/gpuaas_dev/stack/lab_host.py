"""`gpuaas dev up --lab`: a real slice host beside the stack — the lab (tools/gpuaas_dev/lab) with the production
agent enrolled on the stack's bus under its own host identity, as ops onboard a host.

The agent reaches NATS (TLS, its creds, the stack's CA) and the registry at their loopback addresses from inside
the lab's namespace, through the lab's unix-socket forwarders. The host enrols, reports topology and parity, and
takes tasks on its own subject; its slots carry no GPU, which the scheduler does not place yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import node_user_name

from ..lab.agent import LabAgentConfig, start_agent
from ..lab.lab import Lab
from .identities import provision_bus

if TYPE_CHECKING:
    from .stack import Stack

LAB_NODE = "lab-host-1"


def lab_dir(stack: Stack) -> Path:
    return stack.run_dir / "lab"


def clean_leftover_lab(stack: Stack) -> None:
    """A lab a crashed run left (its lab.json survives): removed before a new one is made."""
    leftover = Lab.load(lab_dir(stack))
    if leftover is not None:
        leftover.down()


def start_lab_host(stack: Stack) -> Lab:
    nats_port = urlsplit(stack.nats_url.split(",")[0]).port
    registry_port = int(stack.registry_host.rsplit(":", 1)[1])
    assert nats_port is not None
    lab = Lab(lab_dir(stack), slots=1)
    lab.up(forwards={"nats": nats_port, "registry": registry_port})
    try:
        creds = None
        if stack.auth:
            path = stack.creds_dir / f"{node_user_name(LAB_NODE)}.creds"
            path.unlink(missing_ok=True)
            creds_files.write(path, stack.authority.issue_host(LAB_NODE))
            stack.authority.save(stack.run_dir / "keys")
            creds = str(path)
        provision_bus(stack.nats_options("admin"), [LAB_NODE], replicas=stack.nats_cluster)
        start_agent(
            lab,
            LabAgentConfig(
                node_id=LAB_NODE,
                nats_url=stack.nats_url.split(",")[0],
                nats_creds=creds,
                nats_ca_file=str(stack.ca_file) if stack.ca_file else None,
            ),
        )
    except BaseException:
        lab.down()
        raise
    return lab


def describe_lab(lab: Lab | None) -> dict[str, Any] | None:
    if lab is None or lab.state is None:
        return None
    st = lab.state
    return {
        "netns": st.netns,
        "libvirt_uri": st.libvirt_uri,
        "node_id": LAB_NODE,
        "agent_pid": st.pids.get(f"agent-{LAB_NODE}"),
        "bridge": f"{st.bridge} {st.bridge_cidr}",
        "slots": [{"by_id": s.by_id, "loop": s.loop_device, "mac": s.mac, "ip": s.private_ip} for s in st.slots],
        "state_file": str(lab.state_file),
    }
