"""`gpuaas lab`: real slice hosts on this machine (QEMU/TCG under the lab's own libvirt, in a namespace)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import typer

lab_app = typer.Typer(no_args_is_help=True, add_completion=False, help="The lab: a real slice host on this machine.")

RUN_DIR = typer.Option(Path(".run/lab"), "--run-dir", help="Where the lab keeps its state, logs and disks.")


@lab_app.command("run")
def run(run_dir: Path = RUN_DIR) -> None:
    """Bring the dev stack up with the lab host, allocate one slice onto a real VM, log in, release, stop.

    Example: gpuaas lab run --run-dir .run/lab
    """
    from gpuaas_dev.lab import preflight
    from gpuaas_dev.lab.walk import walk

    try:
        preflight.check()
    except preflight.LabUnavailable as exc:
        typer.echo(f"gpuaas lab: {exc}", err=True)
        raise typer.Exit(3) from None
    ok = asyncio.run(walk(run_dir.resolve(), say=lambda text: print(text, flush=True)))
    raise typer.Exit(0 if ok else 1)


@lab_app.command("down")
def down(run_dir: Path = RUN_DIR) -> None:
    """Remove what a lab left behind (after a crash): domains, daemons, loop devices, the namespace.

    Example: gpuaas lab down --run-dir .run/lab
    """
    from gpuaas_dev.lab.lab import Lab

    lab = Lab.load(run_dir / "lab")
    if lab is None:
        typer.echo("no lab recorded there")
        return
    problems = lab.down()
    for p in problems:
        print(f"left behind: {p}", file=sys.stderr)
    raise typer.Exit(1 if problems else 0)
