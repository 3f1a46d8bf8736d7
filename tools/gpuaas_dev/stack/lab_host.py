"""`gpuaas dev up --lab`: a real slice host beside the stack — the lab (tools/gpuaas_dev/lab) with the production
agent enrolled on the stack's bus under its own host identity, as ops onboard a host.

The agent reaches NATS (TLS, its creds, the stack's CA) and the registry at their loopback addresses from inside
the lab's namespace, through the lab's unix-socket forwarders. The host walks the onboarding a GPU host walks:
it is a MAAS machine of the fleet (commissioned with the slice preflight), its agent enrols, discovers its slots
and runs parity, and the stack approves the discovered candidates through the scheduler's admin API. Its slots
are emulated (a loop-device disk, a MAC and an IP, no GPU and no fabric VF), its parity runs the emulated
profile, and the stack's scheduler, a lab's, allows both. The slice image is published by the pipeline
service and verified in the host's cache before any slice is placed there.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from gpuaas_common.fleet import FleetNode, system_id_for
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import node_user_name

from ..lab.agent import LabAgentConfig, image_cache_dir, start_agent, stop_agent
from ..lab.lab import Lab
from .identities import provision_bus

if TYPE_CHECKING:
    from .stack import Stack

LAB_NODE = "lab-host-1"
# The catalog's cache directory (the pipeline's image_cache_dir): the lab host keeps it under its prefix.
CATALOG_CACHE_DIR = "/var/lib/gpuaas/slice-images"
LAB_SKU = "h200-sxm-slice"
# Pack, push, catalog, pull into the host's cache and verify a ~2 GiB sparse image on two busy cores.
LAB_IMAGE_TIMEOUT_S = 600.0


def lab_fleet_node() -> FleetNode:
    """The lab host as the fleet knows it: a slice host and a MAAS machine, with no slots until discovery."""
    return FleetNode(
        node_id=LAB_NODE,
        kind="slice_host",
        hostname=LAB_NODE,
        sku=LAB_SKU,
        maas_system_id=system_id_for(LAB_NODE),
        simulated=False,
    )


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
    lab = Lab(lab_dir(stack), slots=stack.lab_slots)
    lab.up(forwards={"nats": nats_port, "registry": registry_port})
    try:
        creds = None
        if stack.auth:
            path = stack.creds_dir / f"{node_user_name(LAB_NODE)}.creds"
            path.unlink(missing_ok=True)
            creds_files.write(path, stack.authority.issue_host(LAB_NODE))
            stack.authority.save(stack.run_dir / "keys")
            creds = str(path)
        provision_bus(
            stack.nats_options("admin"),
            [LAB_NODE],
            replicas=stack.nats_cluster,
            host_users={LAB_NODE: stack.authority.issued_hosts.get(LAB_NODE, [])} if stack.auth else None,
            expiry=stack.authority.host_expiry if stack.auth else None,
        )
        start_agent(lab, lab_agent_config(stack, lab, creds))
    except BaseException:
        lab.down()
        raise
    return lab


def lab_agent_config(stack: Stack, lab: Lab, creds: str | None) -> LabAgentConfig:
    assert lab.state is not None
    return LabAgentConfig(
        node_id=LAB_NODE,
        nats_url=stack.nats_url.split(",")[0],
        nats_creds=creds,
        nats_ca_file=str(stack.ca_file) if stack.ca_file else None,
        extra_env={
            "GPUAAS_GPU_BRIDGE": lab.state.bridge,
            "GPUAAS_EMULATED_SLOT_DISKS": ",".join(slot.by_id for slot in lab.state.slots),
            # Tasks and the catalog name the runbook cache path; the lab keeps it under its prefix.
            "GPUAAS_IMAGE_CACHE_DIR": CATALOG_CACHE_DIR,
            "GPUAAS_HOST_PATH_MAP": f"{CATALOG_CACHE_DIR}={image_cache_dir(lab)}",
        },
    )


def restart_lab_agent(stack: Stack, lab: Lab) -> int:
    """Stop the lab host's agent (SIGTERM, as a host's service manager would) and start it again with the same
    settings and identity: what an agent upgrade or a crash-restart does to a host mid-task. Returns the pid."""
    stop_agent(lab, LAB_NODE)
    creds = stack.creds_dir / f"{node_user_name(LAB_NODE)}.creds" if stack.auth else None
    return start_agent(lab, lab_agent_config(stack, lab, str(creds) if creds else None))


def describe_lab(
    lab: Lab | None, image: dict[str, Any] | None = None, stack: Stack | None = None
) -> dict[str, Any] | None:
    if lab is None or lab.state is None:
        return None
    st = lab.state
    machine = None
    if stack is not None and stack.lab_baremetal:
        from .lab_machine import describe_machine

        machine = describe_machine(lab)
        if machine is not None and stack._lab_host_image is not None:
            machine["host_image"] = stack._lab_host_image.get("slug")
    return {
        "baremetal_machine": machine,
        "netns": st.netns,
        "libvirt_uri": st.libvirt_uri,
        "node_id": LAB_NODE,
        "agent_pid": st.pids.get(f"agent-{LAB_NODE}"),
        "bridge": f"{st.bridge} {st.bridge_cidr}",
        "slots": [{"by_id": s.by_id, "loop": s.loop_device, "mac": s.mac, "ip": s.private_ip} for s in st.slots],
        "state_file": str(lab.state_file),
        # What `gpuaas allocate --image` takes to land on the lab host; None until the pipeline activated it.
        "image": {"slug": image["slug"], "digest_sha256": image["digest_sha256"]} if image else None,
    }


async def publish_lab_image(admin_url: str, token: str, timeout_s: float) -> dict[str, Any]:
    """The lab's slice image through the running image pipeline: the artifact (built once per recipe by the
    pipeline's own steps, lab/slice_image.py) is packed, pushed to the registry, written to the catalog and
    prewarmed to every schedulable slice host, which verifies it by digest; the image is `active` only then.
    Returns the catalog row."""
    import aiohttp

    from ..lab.slice_image import ensure_slice_image

    image = await ensure_slice_image()
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(base_url=admin_url, headers=headers) as http:
        body = {"source": str(image.path), "source_format": "raw", "customise": "none", "tag": image.sha256[:16]}
        async with http.post(
            f"/v1/images/{image.slug}/builds", json=body, headers={"Idempotency-Key": f"lab-{image.sha256[:32]}"}
        ) as resp:
            if resp.status >= 300:
                raise RuntimeError(f"image pipeline refused the lab image build: {resp.status} {await resp.text()}")
        while True:
            async with http.get(f"/v1/images/{image.slug}") as resp:
                row = await resp.json() if resp.status == 200 else {}
            if row.get("status") == "active":
                if row.get("digest_sha256") != image.sha256:
                    raise RuntimeError(f"catalog digest {row.get('digest_sha256')} is not the image's {image.sha256}")
                return row
            if time.monotonic() > deadline:
                raise TimeoutError(f"lab image {image.slug} not active after {timeout_s:.0f} s: {row}")
            await asyncio.sleep(1.0)  # polling the catalog's state, which the pipeline moves on its own
