"""What a power driver does after a deploy or release was committed (machines.py stays pure: no I/O, no clock).

Only machines with the `virsh` driver (virsh_power.py) do anything here; the driver's work runs on a thread, and
its outcome ends the phase it was started for, unless the machine moved on meanwhile (released, aborted).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from . import virsh_power
from .machines import Machine, NodeStatus
from .state import SimState

log = structlog.get_logger("gpuaas_dev.maas_sim.power")


def _spawn(state: SimState, machine: Machine, what: str, work, *args) -> None:
    token = machine.phase_token()
    started = time.monotonic()

    async def go() -> None:
        failure = None
        try:
            await asyncio.to_thread(work, *args)
        except virsh_power.PowerFailed as exc:
            failure = str(exc)
        except Exception as exc:  # a driver bug still ends the phase, as a failure MAAS would show
            failure = f"{what} failed: {type(exc).__name__}: {exc}"
        applied = machine.finish_phase(state.now(), token, failure)
        log.info(
            "maas_sim_power",
            system_id=machine.system_id,
            step=what,
            seconds=round(time.monotonic() - started, 2),
            failure=failure,
            applied=applied,
            status=machine.status.label,
        )

    task = asyncio.get_running_loop().create_task(go())
    state.power_tasks.add(task)
    task.add_done_callback(state.power_tasks.discard)


def after_deploy(state: SimState, machine: Machine) -> None:
    if machine.virsh is None or machine.status is not NodeStatus.DEPLOYING:
        return
    deploy = machine.last_deploy or {}
    tgz = state.boot_resources.content(machine.distro_series) if machine.osystem == "custom" else None
    if tgz is None:
        # Stock series boot from MAAS's own images, which this simulator does not carry.
        machine.finish_phase(
            state.now(),
            machine.phase_token(),
            f"Failed deployment: no uploaded image {machine.osystem}/{machine.distro_series} to install",
        )
        return
    params = machine.virsh

    def install_and_boot() -> None:
        # The user-data as the machine will read it, when it boots: after the call that took the deploy returned
        # (a fault may have changed it on the way, app.alter_user_data).
        user_data = (machine.last_deploy or deploy).get("user_data")
        virsh_power.deploy(params, tgz, user_data, machine.system_id, machine.hostname)

    _spawn(state, machine, "deploy", install_and_boot)


def after_release(state: SimState, machine: Machine) -> None:
    if machine.virsh is None or machine.status not in (NodeStatus.RELEASING, NodeStatus.DISK_ERASING):
        return
    erase = machine.erase_mode if machine.status is NodeStatus.DISK_ERASING else None
    _spawn(state, machine, "release", virsh_power.release, machine.virsh, erase)
