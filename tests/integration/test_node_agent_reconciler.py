"""The agent reconciler on a generated XE9680L root (libvirt test:///default, the fixture's driverctl, the real
wipefs/blkid): device-binding and disk drift against the slots the agent was handed, drift tied to its slots,
the drift report on the bus (validated against the contract by the spy), periodic passes, and passes that run
while a task runs without touching its VM."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from gpuaas_node_agent.adapters.host import Host

from .test_node_agent_tasks import Env, env, publish, spy  # noqa: F401  (fixtures)


def _bind(root: Path, bdf: str, driver: str) -> None:
    """What a stray `echo <bdf> > .../nvidia/bind` (or a host that lost its override at reboot) leaves: the
    device's sysfs `driver` link points elsewhere, while the persistent override may still be there."""
    real = (root / "sys/bus/pci/devices" / bdf).resolve()
    target = root / "sys/bus/pci/drivers" / driver
    target.mkdir(parents=True, exist_ok=True)
    (real / "driver").unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, real), real / "driver")


def _write_partition_table(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(446)
        f.write(bytes([0x00, 0, 2, 0, 0x83, 0, 0, 0]) + (2048).to_bytes(4, "little") + (4096).to_bytes(4, "little"))
        f.seek(510)
        f.write(b"\x55\xaa")


def _ours(drift):
    # test:///default brings a `test` domain of its own: the fixture's, not this test's subject.
    return [d for d in drift if d.subject != "test"]


async def test_a_clean_host_reports_no_drift_for_the_slots_it_ran(env: Env) -> None:  # noqa: F811
    live = env.provision([env.slots[0]])
    assert (await env.agent.execute("slice.vm_provision", live)).status == "succeeded"
    done = env.provision([env.slots[1]])
    assert (await env.agent.execute("slice.vm_provision", done)).status == "succeeded"
    assert (await env.agent.execute("slice.vm_release", env.release(done))).status == "succeeded"
    assert _ours(await env.agent.reconcile_host()) == []


async def test_device_binding_drift_names_the_slot_of_the_device(env: Env) -> None:  # noqa: F811
    first, second = env.slots[0], env.slots[1]
    for slot in (first, second):
        prov = env.provision([slot])
        assert (await env.agent.execute("slice.vm_provision", prov)).status == "succeeded"
        assert (await env.agent.execute("slice.vm_release", env.release(prov))).status == "succeeded"
    host = Host.at(env.root)
    # The override of the first slot's GPU removed: driverctl gives the GPU back to nvidia.
    assert (await host.run.run("driverctl", "unset-override", first.gpu_pci_address)).ok
    # The second slot's fabric VF keeps its override but is bound to mlx5_core now.
    assert second.fabric_vf_pci_address is not None
    _bind(env.root, second.fabric_vf_pci_address, "mlx5_core")
    drift = {d.subject: d for d in await env.agent.reconcile_host() if d.kind == "device_binding"}
    assert set(drift) == {first.gpu_pci_address, second.fabric_vf_pci_address}
    gpu = drift[first.gpu_pci_address]
    assert gpu.slot_ids == (first.slot_id,) and gpu.devices == (first.gpu_pci_address,)
    assert "no persistent vfio-pci override" in gpu.detail and "bound to nvidia" in gpu.detail
    vf = drift[second.fabric_vf_pci_address]
    assert vf.slot_ids == (second.slot_id,) and vf.detail == "bound to mlx5_core"
    # A device with an override that the agent never used is still an approved device: its binding counts.
    other = env.slots[5].gpu_pci_address
    _bind(env.root, other, "nvidia")
    drift = {d.subject: d for d in await env.agent.reconcile_host() if d.kind == "device_binding"}
    assert drift[other].slot_ids == () and drift[other].detail == "bound to nvidia"
    # Put right again, the drift is gone.
    assert (await host.run.run("driverctl", "set-override", first.gpu_pci_address, "vfio-pci")).ok
    for bdf in (second.fabric_vf_pci_address, other):
        _bind(env.root, bdf, "vfio-pci")
    assert [d for d in await env.agent.reconcile_host() if d.kind == "device_binding"] == []


async def test_disk_drift_on_idle_slots_only(env: Env) -> None:  # noqa: F811
    live = env.provision([env.slots[0]])
    assert (await env.agent.execute("slice.vm_provision", live)).status == "succeeded"
    idle = env.provision([env.slots[1]])
    assert (await env.agent.execute("slice.vm_provision", idle)).status == "succeeded"
    assert (await env.agent.execute("slice.vm_release", env.release(idle))).status == "succeeded"
    # Written behind the agent's back after the verified wipe; and the live VM's disk carries the same.
    _write_partition_table(env.disk(idle.slots[0].nvme_by_id))
    _write_partition_table(env.disk(live.slots[0].nvme_by_id))
    drift = [d for d in await env.agent.reconcile_host() if d.kind.startswith("disk_")]
    assert [(d.kind, d.subject, d.slot_ids) for d in drift] == [
        ("disk_dirty", idle.slots[0].nvme_by_id, (idle.slots[0].slot_id,))
    ]
    assert "dos" in drift[0].detail
    # The disk of a slot whose provision was refused, mounted since: unusable, named by its slot.
    mounted = env.slots[7]  # nvme8: the fixture mounts a partition of it
    refused = env.provision([mounted])
    assert (await env.agent.execute("slice.vm_provision", refused)).status == "refused"
    drift = {d.subject: d for d in await env.agent.reconcile_host() if d.kind.startswith("disk_")}
    assert drift[mounted.nvme_by_id].kind == "disk_unusable"
    assert drift[mounted.nvme_by_id].slot_ids == (mounted.slot_id,)


async def test_domain_missing_and_orphaned_lease_name_their_slots(env: Env) -> None:  # noqa: F811
    live = env.provision(env.slots[2:4])
    assert (await env.agent.execute("slice.vm_provision", live)).status == "succeeded"
    await env.libvirt.shutdown(live.vm_name, 0)
    await env.libvirt.undefine(live.vm_name)
    env.agent.store.take_leases([f"nvme:{env.slots[6].nvme_by_id}"], "gone-allocation")
    drift = {(d.kind, d.subject): d for d in await env.agent.reconcile_host()}
    missing = drift[("domain_missing", live.vm_name)]
    assert missing.slot_ids == (env.slots[2].slot_id, env.slots[3].slot_id)
    lease = drift[("lease_orphaned", f"nvme:{env.slots[6].nvme_by_id}")]
    assert lease.devices == (env.slots[6].nvme_by_id,)
    assert drift[("domain_unmanaged", "test")].slot_ids == ()  # unknown holder: the whole node


async def test_periodic_passes_publish_the_full_list_each_time(env: Env) -> None:  # noqa: F811
    from gpuaas_node_agent.adapters import dnsmasq

    loop = asyncio.create_task(env.agent.reconcile_periodically(0.05))
    try:
        first = await env.spy.wait_type("node.drift_reported", node_id=env.node_id)
        assert [d["subject"] for d in first["payload"]["drift"]] == ["test"]
        dnsmasq.write_reservation(env.agent.hostsdir, "by-hand", "52:54:00:aa:00:02", "127.101.1.98", "ops-vm")
        await env.spy.wait_for(
            lambda: any(
                any(d["subject"] == "by-hand" for d in e["payload"]["drift"])
                for e in env.spy.of_type("node.drift_reported", node_id=env.node_id)
            ),
            what="a report naming the hand-written reservation",
        )
        by_hand = next(
            d
            for e in env.spy.of_type("node.drift_reported", node_id=env.node_id)
            for d in e["payload"]["drift"]
            if d["subject"] == "by-hand"
        )
        assert by_hand["kind"] == "dhcp_reservation_orphaned" and not by_hand["swept"]
        assert by_hand["devices"] == ["52:54:00:aa:00:02", "127.101.1.98"]
        # Removed by ops: a later report no longer carries it (each report is the whole truth).
        dnsmasq.remove_reservation(env.agent.hostsdir, "by-hand")
        seen = len(env.spy.of_type("node.drift_reported", node_id=env.node_id))

        def clean_again() -> bool:
            later = env.spy.of_type("node.drift_reported", node_id=env.node_id)[seen:]
            return any(all(d["subject"] != "by-hand" for d in e["payload"]["drift"]) for e in later)

        await env.spy.wait_for(clean_again, what="a report without the reservation")
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_passes_during_a_provision_leave_its_vm_alone(env: Env) -> None:  # noqa: F811
    prov = env.provision(env.slots[4:6])
    task = asyncio.create_task(env.agent.execute("slice.vm_provision", prov))
    passes = []
    while not task.done():
        passes.append(await env.agent.reconcile_host())
    result = await task
    assert result.status == "succeeded", result
    assert len(passes) >= 1
    names = {prov.vm_name, *(s.slot_id for s in prov.slots), *(s.nvme_by_id for s in prov.slots)}
    for drift in passes:
        assert not [d for d in drift if d.subject in names or set(d.slot_ids) & names], drift
    assert await env.libvirt.exists(prov.vm_name)


async def test_a_stale_domain_is_left_alone_while_its_vm_lock_is_held(env: Env) -> None:  # noqa: F811
    prov = env.provision([env.slots[6]])
    assert (await env.agent.execute("slice.vm_provision", prov)).status == "succeeded"
    assert (await env.agent.execute("slice.vm_release", env.release(prov))).status == "succeeded"
    # A released VM's domain back (as a crash between define and the record would leave it), while a task
    # for that VM holds its lock: the reconciler must wait for another pass.
    await env.libvirt.define_and_start(_minimal_domain(prov.vm_name))
    lock = env.agent.locks.vm(prov.vm_name)
    async with lock:
        await env.agent.reconcile_host()
        assert await env.libvirt.exists(prov.vm_name)
    await env.agent.reconcile_host()
    assert not await env.libvirt.exists(prov.vm_name)


def _minimal_domain(name: str) -> str:
    return (
        f"<domain type='test'><name>{name}</name><memory unit='MiB'>64</memory><vcpu>1</vcpu>"
        "<os><type arch='x86_64'>hvm</type></os></domain>"
    )
