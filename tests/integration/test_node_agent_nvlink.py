"""The NVLink partition on the host (issue 29, point 3), with the agent of test_node_agent_tasks on a generated
XE9680L root and the simulated Fabric Manager: reset, activate, then the VM; shut down, deactivate, reset; an
in-use partition refuses the task before the disk is touched; after a Fabric Manager restart the agent re-sends
the active list inside the 60-second window (and Fabric Manager exits without it); reconciliation reports a
partition active with no VM behind it."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpuaas_node_agent.adapters.fabric_manager import (
    IN_USE,
    NOT_READY,
    NOT_RUNNING,
    FabricManagerError,
    FmpmFabricManager,
    SimulatedFabricManager,
    fabric_manager_for,
)
from gpuaas_node_agent.adapters.host import Host

from .test_node_agent_tasks import Env, _fill, _make_env, publish, spy  # noqa: F401 (fixtures)

# Module IDs of the fixture board in slot order (pairs behind one PCIe switch): slots 0 and 1 are modules 1 and 3.
MODULES = (1, 3, 2, 4, 5, 7, 6, 8)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def env(tmp_path: Path, publish, spy, clock: Clock) -> AsyncIterator[Env]:  # noqa: F811
    """The agent of test_node_agent_tasks, given a simulated Fabric Manager on the test's clock."""

    def simulated(root: Path) -> SimulatedFabricManager:
        return SimulatedFabricManager(root / "var/lib/gpuaas/fm.json", clock=clock)

    async for e in _make_env(tmp_path, publish, spy, fabric_manager=simulated):
        yield e


def fabric(e: Env) -> SimulatedFabricManager:
    fm = e.agent.nvlink.fabric()
    assert isinstance(fm, SimulatedFabricManager)
    return fm


def slots(e: Env, *indexes: int):
    return [e.slots[i].model_copy(update={"module_id": MODULES[i]}) for i in indexes]


def record_vm_start(e: Env, fm: SimulatedFabricManager) -> None:
    start = e.agent.libvirt.define_and_start

    async def define_and_start(xml: str):
        fm.events.append(("vm_start", None))
        return await start(xml)

    e.agent.libvirt.define_and_start = define_and_start  # type: ignore[method-assign]


async def test_activation_precedes_the_vm_and_deactivation_follows_its_shutdown(env: Env) -> None:  # noqa: F811
    fm = fabric(env)
    record_vm_start(env, fm)
    prov = env.provision(slots(env, 0, 1)).model_copy(update={"nvlink_partition": 3})
    result = await env.agent.execute("slice.vm_provision", prov)
    assert result.status == "succeeded", result
    gpus = [s.gpu_pci_address for s in prov.slots]
    assert fm.events == [("reset", gpus[0]), ("reset", gpus[1]), ("activate", 3), ("vm_start", None)]
    assert await fm.active() == [3] and env.agent.nvlink.held() == {prov.vm_name: 3}
    fm.events.clear()
    shut = env.agent.libvirt.undefine

    async def undefine(name: str):
        fm.events.append(("vm_gone", name))
        return await shut(name)

    env.agent.libvirt.undefine = undefine  # type: ignore[method-assign]
    released = await env.agent.execute("slice.vm_release", env.release(prov))
    assert released.status == "succeeded", released
    assert fm.events == [("vm_gone", prov.vm_name), ("deactivate", 3), ("reset", gpus[0]), ("reset", gpus[1])]
    assert await fm.active() == [] and env.agent.nvlink.held() == {}


async def test_an_in_use_partition_refuses_the_task_before_the_disk(env: Env) -> None:  # noqa: F811
    fm = fabric(env)
    await fm.activate(1)  # the first half, which holds modules 1 and 3, is active already
    prov = env.provision(slots(env, 0, 1)).model_copy(update={"nvlink_partition": 3})
    disks = [env.disk(s.nvme_by_id) for s in prov.slots]
    before = [_fill(d) for d in disks]
    result = await env.agent.execute("slice.vm_provision", prov)
    assert (result.status, result.reason_code, result.disk_touched) == ("refused", "nvlink_partition_in_use", False)
    assert "FM_ST_IN_USE" in (result.reason or "")
    assert [hashlib.sha256(d.read_bytes()).digest() for d in disks] == before
    assert not await env.libvirt.exists(prov.vm_name)
    assert env.agent.store.leased_resources() == {} and await fm.active() == [1]


async def test_after_a_restart_the_active_list_is_resent_within_the_window(env: Env, clock: Clock) -> None:
    fm = fabric(env)
    prov = env.provision(slots(env, 4, 5)).model_copy(update={"nvlink_partition": 5})
    assert (await env.agent.execute("slice.vm_provision", prov)).status == "succeeded"
    seen = await env.agent.nvlink.resend_if_restarted(None)
    fm.restart()
    # Inside the window nothing may be activated or deactivated until the list comes.
    try:
        await fm.activate(6)
        raise AssertionError("activation inside the restart window")
    except FabricManagerError as exc:
        assert exc.code == NOT_READY
    clock.now += 30
    await env.agent.nvlink.resend_if_restarted(seen)
    assert fm.events[-1] == ("set_activated", (5,)) and await fm.active() == [5]
    await fm.activate(6)  # accepted again
    # Without the list Fabric Manager exits once the 60 seconds are up.
    fm.restart()
    clock.now += 61
    try:
        await fm.active()
        raise AssertionError("Fabric Manager still running past its window")
    except FabricManagerError as exc:
        assert exc.code == NOT_RUNNING


async def test_reconciliation_reports_a_partition_no_vm_holds(env: Env) -> None:  # noqa: F811
    fm = fabric(env)
    prov = env.provision(slots(env, 2, 3)).model_copy(update={"nvlink_partition": 4})
    assert (await env.agent.execute("slice.vm_provision", prov)).status == "succeeded"
    await fm.activate(13)  # module 7's single partition, activated by nobody the agent knows
    drift = [d for d in await env.agent.reconcile_host() if d.kind == "nvlink_partition"]
    assert [(d.subject, d.detail) for d in drift] == [
        ("partition:13", "NVLink partition 13 is active with no live VM of the agent's")
    ]
    await fm.deactivate(4)  # the VM's own partition gone under it
    drift = [d for d in await env.agent.reconcile_host() if d.kind == "nvlink_partition"]
    assert ("partition:4", f"VM {prov.vm_name} runs without its NVLink partition 4 active") in [
        (d.subject, d.detail) for d in drift
    ]


LISTING = """{
   "version" : 1,
   "numPartitions" : 3,
   "partitionInfo" : [
      { "partitionId" : 1, "isActive" : 0, "numGpus" : 4, "gpuInfo" : [] },
      { "partitionId" : 4, "isActive" : 1, "numGpus" : 2, "gpuInfo" : [] },
      { "partitionId" : 9, "isActive" : 1, "numGpus" : 1, "gpuInfo" : [] }
   ]
}"""


async def test_the_real_adapter_reads_fmpm_and_tells_in_use_from_other_refusals(tmp_path) -> None:
    """fmpm prints its listing as JSON and exits with Fabric Manager's fmReturn_t (256 + the negative code)."""
    tool = tmp_path / "usr/bin/fmpm"
    tool.parent.mkdir(parents=True)
    (tmp_path / "fmpm-list.json").write_text(LISTING)
    tool.write_text(
        "#!/bin/sh\n"
        'D="$(dirname "$0")/../.."\n'
        'case "$1" in\n'
        '  -l) cat "$D/fmpm-list.json";;\n'
        '  -a) [ "$2" = "3" ] && { echo "Failed to activate partition. fmReturn: -7"; exit 249; }; echo done;;\n'
        '  -d) echo "Failed to deactivate partition. fmReturn: -8"; exit 248;;\n'
        '  --set-activated-list) echo "$2" > "$D/activated.txt";;\n'
        "esac\n"
    )
    tool.chmod(0o755)
    host = Host.at(tmp_path)
    fm = fabric_manager_for(host, tmp_path / "state")
    assert isinstance(fm, FmpmFabricManager)
    assert await fm.active() == [4, 9]
    await fm.activate(5)
    with pytest.raises(FabricManagerError) as in_use:
        await fm.activate(3)
    assert in_use.value.code == IN_USE
    with pytest.raises(FabricManagerError) as not_ready:
        await fm.deactivate(4)
    assert not_ready.value.code == NOT_READY
    await fm.set_activated([9, 4])
    assert (tmp_path / "activated.txt").read_text().strip() == "4,9"
    # A host tree without fmpm gets the simulator, never a silent stand-in on a real host.
    assert isinstance(fabric_manager_for(Host.at(tmp_path / "other"), tmp_path / "state"), SimulatedFabricManager)
