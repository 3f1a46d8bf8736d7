"""`gpuaas-node-agent discover|parity` (also `gpuaas node-agent …`): read-only host checks from a root.

Run on a host with `--root /`, or against a generated fixture tree. Without a subcommand
`gpuaas-node-agent` runs the agent service.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from gpuaas_common.logging import configure_logging

from ..adapters.discovery import discover
from ..adapters.driverctl import DriverctlError
from ..adapters.host import Host
from ..adapters.parity import ParityChecker, format_lines
from ..service_layer.device_binding import enter_slice_mode, leave_slice_mode

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Node agent host checks.")


@app.callback()
def _logs_to_stderr() -> None:
    # stdout carries the report (JSON or parity lines); structured logs must not interleave with it.
    configure_logging("node-agent", os.environ.get("GPUAAS_LOG_LEVEL", "WARNING"))


RootOpt = Annotated[Path, typer.Option("--root", help="Host root: / on a host, or a fixture tree.")]
NodeIdOpt = Annotated[Optional[str], typer.Option("--node-id", help="Default: the root's /etc/hostname.")]


# A missing root is a usage error (2), distinct from a check that ran and failed (1).
EXIT_NO_ROOT = 2


def _host(root: Path) -> Host:
    """The host at `root`, or one line on stderr and exit 2: checks against a root that is not there would
    report every device missing, which reads like a broken host rather than a typo."""
    if not root.is_dir():
        typer.echo(f"no such root: {root} (give / on a host, or a fixture tree)", err=True)
        raise typer.Exit(EXIT_NO_ROOT)
    return Host.at(root)


def _node_id(root: Path, node_id: Optional[str]) -> str:
    if node_id:
        return node_id
    name = Host.at(root).fs.read("/etc/hostname")
    return name or os.uname().nodename


@app.command("discover")
def discover_cmd(
    root: RootOpt = Path("/"),
    node_id: NodeIdOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the topology report as JSON.")] = False,
) -> None:
    """GPUs, fabric devices, NVMe disks and advisory candidate slots."""
    host = _host(root)
    report = asyncio.run(discover(host, _node_id(root, node_id)))
    if as_json:
        typer.echo(json.dumps(report.model_dump(mode="json"), indent=2))
        return
    for g in report.gpus:
        typer.echo(
            f"gpu    {g.pci_address} {g.vendor_id}:{g.device_id} numa={g.numa_node} "
            f"iommu_group={g.iommu_group} driver={g.driver}"
        )
    for f in report.fabric:
        typer.echo(
            f"fabric {f.pci_address} {f.role} {f.vendor_id}:{f.device_id} ib={f.ib_device} "
            f"state={f.ib_port_state!r} vfs={f.sriov_numvfs}/{f.sriov_totalvfs}"
        )
    for d in report.nvme:
        typer.echo(
            f"nvme   {d.kernel_name} {d.by_id} os={d.is_os_disk} mounted={d.mounted} "
            f"children={','.join(d.mounted_children) or '-'} candidate={d.candidate}"
            + (f" ({d.excluded_reason})" if d.excluded_reason else "")
        )
    for c in report.candidate_slots:
        typer.echo(
            f"slot   {c.index} gpu={c.gpu_pci_address} nvme={c.nvme_by_id} vf={c.fabric_vf_pci_address} "
            f"mac={c.mac} ip={c.private_ip} port={c.ovs_port} complete={c.complete}"
        )
    for b in report.blockers:
        typer.echo(f"blocker {b}")


@app.command("parity")
def parity_cmd(root: RootOpt = Path("/"), node_id: NodeIdOpt = None) -> None:
    """One GPUAAS_SLICE_PARITY line per runbook condition and a summary; exit 1 when anything failed."""
    host = _host(root)
    report = asyncio.run(ParityChecker(host).run(_node_id(root, node_id)))
    for line in format_lines(report):
        typer.echo(line)
    if report.failures:
        raise typer.Exit(1)


slice_mode = typer.Typer(no_args_is_help=True, help="Persistent vfio-pci binding of the approved devices.")
app.add_typer(slice_mode, name="slice-mode")


@slice_mode.command("enter")
def slice_mode_enter(
    device: Annotated[list[str], typer.Option("--device", help="Approved GPU or fabric VF (BDF); repeat.")],
    root: RootOpt = Path("/"),
) -> None:
    """Write a driverctl vfio-pci override for every approved device (and drop overrides no longer approved)."""
    try:
        done = asyncio.run(enter_slice_mode(_host(root), device))
    except DriverctlError as exc:
        typer.echo(f"slice-mode enter failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"set={','.join(done.set_override) or '-'} unset={','.join(done.unset_override) or '-'}")


@slice_mode.command("leave")
def slice_mode_leave(root: RootOpt = Path("/")) -> None:
    """Remove every vfio-pci driverctl override: the devices return to their host drivers."""
    try:
        done = asyncio.run(leave_slice_mode(_host(root)))
    except DriverctlError as exc:
        typer.echo(f"slice-mode leave failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"unset={','.join(done.unset_override) or '-'}")


@app.command("run")
def run_cmd() -> None:
    """Run the agent service (configured by GPUAAS_* variables)."""
    from .main import serve

    serve()
