"""The simulated fleet the stack runs: fleet.json, the MAAS simulator's machine list, seed images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuaas_common.fleet import Fleet, FleetNode, generate_fleet

from ..seed_images import build_seed

FLEET_SUBNET = "127.100.0.0/16"


def maas_machines(fleet: Fleet) -> list[dict[str, Any]]:
    """The simulator's machine list: every fleet node MAAS knows (baremetal hosts, and slice hosts, which
    MAAS commissions), so their system ids agree."""
    return [
        {
            "system_id": n.maas_system_id,
            "hostname": n.hostname,
            "tags": ["gpuaas", n.sku] + (["gpuaas-profile-slice-vm"] if n.kind == "slice_host" else []),
        }
        for n in fleet.nodes
        if n.maas_system_id
    ]


def prepare_fleet_dir(
    out_dir: Path,
    *,
    slice_hosts: int = 4,
    slots_per_host: int = 8,
    baremetal_hosts: int = 2,
    ssh_port: int = 2222,
    hosts_root: Path | None = None,
    real_hosts: list[FleetNode] | None = None,
) -> dict[str, Path]:
    """Write what the stack's processes read at start: fleet, MAAS machine list, seed images.

    Shared by `Stack` and `gpuaas dev fleet` (the compose file's init step), so both run the same fleet.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    fleet = generate_fleet(
        slice_hosts=slice_hosts,
        slots_per_host=slots_per_host,
        baremetal_hosts=baremetal_hosts,
        root_dir=hosts_root or out_dir / "hosts",
        subnet=FLEET_SUBNET,
        ssh_port=ssh_port,
    )
    # Real hosts (the lab's) join the fleet as MAAS machines and scheduler nodes; their own agents run.
    fleet.nodes.extend(real_hosts or [])
    fleet_file = out_dir / "fleet.json"
    fleet.dump(fleet_file)
    machines_file = out_dir / "maas-machines.json"
    machines_file.write_text(json.dumps(maas_machines(fleet), indent=2))
    images_dir = out_dir / "images"
    seed_file = build_seed(images_dir)
    return {"fleet": fleet_file, "machines": machines_file, "images": images_dir, "seed": seed_file}
