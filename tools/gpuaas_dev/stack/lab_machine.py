"""`gpuaas dev up --lab`'s baremetal machine: a MAAS machine of the simulator that is a real VM in the lab.

The simulator drives it with its `virsh` power driver (maas_sim/virsh_power.py) on the lab's libvirtd; its NIC
is on the lab's bridge with the address MAAS assigned it (a DHCP reservation in the lab's dnsmasq, as MAAS
serves DHCP for its machines). The host image it boots is the lab's curated host image (lab/host_image.py),
archived and uploaded by the image pipeline through the MAAS gateway, and the site profile deploys it with a
bootstrap that tells the node agent where the bus is: the bridge's address, where the lab forwards the stack's
NATS port (the only way out of the namespace), under a server certificate that names that address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gpuaas_common.fleet import FleetNode, system_id_for

from ..lab.lab import BRIDGE_CIDR, Lab

if TYPE_CHECKING:
    from .stack import Stack

LAB_MACHINE = "lab-bm-1"
LAB_MACHINE_SKU = "h200-sxm"
# Past the slots' addresses (10.100.0.10 + N).
LAB_MACHINE_IP = str(ipaddress.ip_interface(BRIDGE_CIDR).network.network_address + 50)
GUEST_GATEWAY = str(ipaddress.ip_interface(BRIDGE_CIDR).ip)
# The profile the allocator deploys baremetal allocations with (its GPUAAS_BAREMETAL_PROFILE default).
PROFILE = "h200-baremetal"
HOST_IMAGE_TIMEOUT_S = 900.0
AGENT_CA_PATH = "/etc/gpuaas/nats-ca.pem"


def lab_machine_node() -> FleetNode:
    return FleetNode(
        node_id=LAB_MACHINE,
        kind="baremetal",
        hostname=LAB_MACHINE,
        sku=LAB_MACHINE_SKU,
        maas_system_id=system_id_for(LAB_MACHINE),
        simulated=False,
    )


def site_bootstrap(nats_port: int, ca_pem: str) -> str:
    """The site's cloud-config for the lab: where the agent finds the bus and which CA signed it, and the site
    bootstrap run from the image (the gateway appends the agent's own files to this)."""
    doc = {
        "write_files": [
            {
                "path": "/etc/gpuaas/agent.env",
                "permissions": "0644",
                "content": f"GPUAAS_NATS_URL=tls://{GUEST_GATEWAY}:{nats_port}\nGPUAAS_NATS_CA_FILE={AGENT_CA_PATH}\n",
            },
            {"path": AGENT_CA_PATH, "permissions": "0644", "content": ca_pem},
        ],
        "runcmd": [["/usr/local/share/gpuaas/site-bootstrap/h200-ib/bootstrap.sh"]],
    }
    return "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False)


def gateway_profiles(stack: Stack, slug: str) -> str:
    assert stack.ca_file is not None
    profile = {
        "distro_series": slug,
        "storage_layout": "flat",
        # The lab's host image is Debian's: cloud-init's default user there is `debian`.
        "login_user": "debian",
        "bootstrap_user_data": site_bootstrap(stack.nats_port, Path(stack.ca_file).read_text()),
    }
    return json.dumps({PROFILE: profile})


def machine_dir(lab: Lab) -> Path:
    assert lab.state is not None
    return Path(lab.state.host_dir) / "maas" / LAB_MACHINE


def mac_address() -> str:
    from ..maas_sim.machines import Machine

    return Machine(system_id=system_id_for(LAB_MACHINE), hostname=LAB_MACHINE).mac_address


def attach_machine(stack: Stack, lab: Lab) -> dict[str, Any]:
    """The VM's disk, its address and the bus forward for guests; then the simulator drives it by virsh."""
    import urllib.request

    assert lab.state is not None
    work = machine_dir(lab)
    work.mkdir(mode=0o755, parents=True, exist_ok=True)
    disk = work / "disk.img"
    with disk.open("wb") as f:
        f.truncate(4 << 30)
    mac = mac_address()
    Path(lab.state.hostsdir, f"maas-{LAB_MACHINE}").write_text(f"{mac},{LAB_MACHINE_IP}\n")
    lab.forward("nats-guests", stack.nats_port, bind=GUEST_GATEWAY)
    body = {
        "power_parameters": {
            "power_address": lab.state.libvirt_uri,
            "power_id": f"maas-{LAB_MACHINE}",
            "disk": str(disk),
            "work_dir": str(work),
            "bridge": lab.state.bridge,
            "mac_address": mac,
        },
        "ip_address": LAB_MACHINE_IP,
    }
    req = urllib.request.Request(
        f"{stack.maas_base_url}/_sim/machines/{system_id_for(LAB_MACHINE)}/power",
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


async def publish_host_image(admin_url: str, token: str, timeout_s: float) -> dict[str, Any]:
    """The lab's host image through the running pipeline: the tree (built once per recipe) is archived as a tgz
    with the curtin marker, catalogued and uploaded by the MAAS gateway as `custom/<slug>`. Returns the row."""
    import aiohttp

    from ..lab.host_image import ensure_host_image_tree

    tree = await ensure_host_image_tree()
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(base_url=admin_url, headers=headers) as http:
        body = {
            "rootfs": str(tree.rootfs),
            "title": "gpuaas lab host (Debian 12)",
            "base_image": "custom/debian-12",
            "compatible_sku": LAB_MACHINE_SKU,
        }
        async with http.post(
            f"/v1/images/{tree.slug}/host-upload", json=body, headers={"Idempotency-Key": f"lab-host-{tree.key}"}
        ) as resp:
            if resp.status >= 300:
                raise RuntimeError(f"image pipeline refused the lab host image: {resp.status} {await resp.text()}")
        while True:
            async with http.get(f"/v1/images/{tree.slug}") as resp:
                row = await resp.json() if resp.status == 200 else {}
            maas = (row.get("metadata") or {}).get("maas") or {}
            if maas.get("status") == "uploaded":
                return row
            if maas.get("status") == "failed":
                raise RuntimeError(f"the gateway could not upload the lab host image: {maas}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"lab host image {tree.slug} not uploaded after {timeout_s:.0f} s: {maas}")
            await asyncio.sleep(1.0)  # the pipeline records the gateway's result on its own


def describe_machine(lab: Lab | None) -> dict[str, Any] | None:
    if lab is None or lab.state is None:
        return None
    return {
        "hostname": LAB_MACHINE,
        "system_id": system_id_for(LAB_MACHINE),
        "ip": LAB_MACHINE_IP,
        "domain": f"maas-{LAB_MACHINE}",
        "disk": str(machine_dir(lab) / "disk.img"),
        "console_log": str(machine_dir(lab) / "console.log"),
    }
