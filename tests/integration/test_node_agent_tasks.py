"""SliceHostAgent on a generated XE9680L root: libvirt test:///default, real qemu-img, pycdlib seed ISOs, the
simulated DHCP/guest on loopback, events on a real nats-server. Refusals are checked before anything
destructive runs: the disk bytes must be unchanged."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
import yaml

from gpuaas_common.contract import Envelope, spec_for, utcnow
from gpuaas_common.contract import messages as m
from gpuaas_common.jetstream import provision
from gpuaas_dev.sim.dhcp_guest import GuestFault, SimulatedDhcpAndGuest, passed_through_gpus
from gpuaas_dev.sim.fixture_host import build_host_root, xe9680l
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.servers import free_port
from gpuaas_node_agent.adapters.discovery import stable_ids
from gpuaas_node_agent.adapters.fabric_manager import FabricManager
from gpuaas_node_agent.adapters.host import HostFs
from gpuaas_node_agent.adapters.libvirt_host import LibvirtHost
from gpuaas_node_agent.adapters.state_store import StateStore
from gpuaas_node_agent.domain.domain_xml import tap_name
from gpuaas_node_agent.service_layer.host_paths import HostPaths
from gpuaas_node_agent.service_layer.tasks import SliceHostAgent
from tests.integration.test_node_agent_seed_iso import _read as read_seed_iso

MIB = 1 << 20
MARKER = b"TENANT-DATA-MUST-SURVIVE-A-REFUSAL" * 64
IMAGE_PATTERN = b"GPUAAS-SLICE-IMAGE" * 100
IMAGE_PATH = "/var/lib/gpuaas/slice-images/slice.raw"


class Env:
    def __init__(
        self,
        root: Path,
        node_id: str,
        agent: SliceHostAgent,
        spy: BusSpy,
        digest: str,
        ssh_port: int,
        libvirt: LibvirtHost,
        guests: SimulatedDhcpAndGuest,
    ) -> None:
        self.root, self.node_id, self.agent, self.spy, self.digest = root, node_id, agent, spy, digest
        self.ssh_port, self.libvirt, self.guests = ssh_port, libvirt, guests
        self.slots = self._slots()

    def _slots(self) -> list[m.SlotBinding]:
        ids = stable_ids(HostFs(self.root))
        octet = int(self.node_id.rsplit("-", 1)[-1], 16)
        gpus = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]
        out = []
        # Data disks are nvme0..3,5..8 (nvme4 is the OS disk, nvme8 carries a mounted share partition).
        for i, ctrl in enumerate([0, 1, 2, 3, 5, 6, 7, 8]):
            out.append(
                m.SlotBinding(
                    slot_id=f"{self.node_id}-s{i}",
                    gpu_pci_address=f"0000:{gpus[i]}:00.0",
                    nvme_by_id=ids[f"nvme{ctrl}n1"],
                    fabric_vf_pci_address=f"0000:{'29' if i < 4 else 'a9'}:00.{i % 4 + 1}",
                    mac=f"52:54:00:{octet:02x}:00:{i:02x}",
                    private_ip=f"127.101.{octet}.{10 + i}",
                    ovs_bridge="ovsbr0",
                    numa_node=0 if i < 4 else 1,
                    profile="h200_1g_24c_64g",
                )
            )
        return out

    def disk(self, by_id: str) -> Path:
        return (self.root / by_id.lstrip("/")).resolve()

    def by_id(self, kernel_name: str) -> str:
        return stable_ids(HostFs(self.root))[kernel_name]

    def provision(
        self,
        slots: list[m.SlotBinding],
        *,
        epoch: int = 1,
        digest: str | None = None,
        deadline_s: float = 60,
        allocation_id: uuid.UUID | None = None,
    ) -> m.SliceVmProvision:
        alloc = allocation_id or uuid.uuid4()
        return m.SliceVmProvision(
            task_id=f"prov-{uuid.uuid4().hex[:12]}",
            allocation_id=alloc,
            node_id=self.node_id,
            fencing_epoch=epoch,
            deadline=utcnow() + timedelta(seconds=deadline_s),
            vm_name=f"it-{alloc.hex[:12]}",
            slots=slots,
            image=m.ImageRef(slug="slice", digest_sha256=digest or self.digest, image_path=IMAGE_PATH),
            ssh_public_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGl0IHRlc3Qga2V5IG9ubHk tenant@example"],
            hostname="it-vm",
        )

    def release(self, prov: m.SliceVmProvision, *, epoch: int | None = None) -> m.SliceVmRelease:
        return m.SliceVmRelease(
            task_id=f"rel-{uuid.uuid4().hex[:12]}",
            allocation_id=prov.allocation_id,
            node_id=self.node_id,
            fencing_epoch=epoch or prov.fencing_epoch,
            deadline=utcnow() + timedelta(seconds=60),
            vm_name=prov.vm_name,
            slots=prov.slots,
        )


def _fill(path: Path) -> bytes:
    data = (MARKER * (path.stat().st_size // len(MARKER) + 1))[: path.stat().st_size]
    path.write_bytes(data)
    return hashlib.sha256(data).digest()


def _digest(path: Path) -> bytes:
    return hashlib.sha256(path.read_bytes()).digest()


@pytest.fixture
async def spy(nats_server) -> AsyncIterator[BusSpy]:
    s = await BusSpy(nats_server.url).start()
    yield s
    await s.stop()
    assert s.violations == [], s.violations[:3]


@pytest.fixture
async def publish(nats_server):
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await provision(js)

    async def _publish(
        type_: str,
        payload: Any,
        *,
        correlation_id: str,
        causation_id: str | None = None,
        event_id: str | None = None,
        timeout: float = 5.0,
        **params: str,
    ) -> Envelope:
        env = Envelope.wrap(
            type_,
            payload.model_dump(mode="json"),
            producer="node-agent",
            correlation_id=correlation_id,
            causation_id=causation_id,
            event_id=event_id,
        )
        await js.publish(
            spec_for(type_).subject(**params),
            env.model_dump_json().encode(),
            headers={"Nats-Msg-Id": env.event_id},
            timeout=timeout,
        )
        return env

    yield _publish
    await nc.drain()


async def _make_env(
    tmp_path: Path,
    publish,
    spy: BusSpy,
    *,
    dhcp: bool = True,
    shutdown_timeout_s: float = 5.0,
    readiness_timeout_s: float = 30,
    fabric_manager: Callable[[Path], FabricManager] | None = None,
    **host: Any,
) -> AsyncIterator[Env]:
    """`fabric_manager`: made from the host root, for an agent that uses it in place of the host's own."""
    node_id = f"it-{uuid.uuid4().hex[:2]}"
    root = build_host_root(tmp_path / "host", xe9680l(node_id, disk_file_bytes=4 * MIB, **host))
    image = root / IMAGE_PATH.lstrip("/")
    image.parent.mkdir(parents=True)
    image.write_bytes(IMAGE_PATTERN + bytes(MIB - len(IMAGE_PATTERN)))
    digest = hashlib.sha256(image.read_bytes()).hexdigest()
    paths = HostPaths(root)
    port = free_port()
    libvirt = LibvirtHost("test:///default", poll_interval_s=0.02)
    sim = SimulatedDhcpAndGuest(
        paths.host("/etc/gpuaas/dnsmasq-hosts"),
        paths.host("/var/lib/misc/dnsmasq.leases"),
        port,
        poll_interval_s=0.02,
        gpus_of=passed_through_gpus(libvirt, root),
    )
    if dhcp:
        await sim.start()
    store = StateStore(root / "var/lib/gpuaas/agent/agent.sqlite")
    agent = SliceHostAgent(
        node_id,
        paths,
        store,
        libvirt,
        publish,
        hostsdir="/etc/gpuaas/dnsmasq-hosts",
        lease_file="/var/lib/misc/dnsmasq.leases",
        seed_dir="/var/lib/gpuaas/seeds",
        ssh_port=port,
        readiness_timeout_s=readiness_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
        relay_public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHJlbGF5 relay@node",
        guest_login=sim.login,
        fabric_manager=fabric_manager(root) if fabric_manager else None,
    )
    paths.host("/var/lib/gpuaas/seeds").mkdir(parents=True, exist_ok=True)
    env = Env(root, node_id, agent, spy, digest, port, libvirt, sim)
    try:
        yield env
    finally:
        # Bounded: a teardown that waits forever hangs the whole suite after the per-test timeout has fired.
        await asyncio.wait_for(sim.stop(), 30)
        for dom in await asyncio.wait_for(libvirt.list_domains(), 30):
            if dom.name.startswith("it-"):
                await libvirt.shutdown(dom.name, 0)
                await libvirt.undefine(dom.name)
        await libvirt.close()
        store.close()


@pytest.fixture
async def env(tmp_path: Path, publish, spy) -> AsyncIterator[Env]:
    async for e in _make_env(tmp_path, publish, spy):
        yield e


# --- the happy path -----------------------------------------------------------------------------------


async def test_provision_then_release_clones_boots_and_wipes_with_proof(env: Env) -> None:
    prov = env.provision(env.slots[:2])
    disks = [env.disk(s.nvme_by_id) for s in prov.slots]
    _fill(disks[0])
    result = await env.agent.execute("slice.vm_provision", prov)
    assert result.status == "succeeded", result
    assert result.readiness and result.readiness.ssh_ready and result.readiness.actual_ip == prov.slots[0].private_ip
    # The guest reported both GPUs its domain was given, with the driver a preinstalled image has.
    assert result.readiness.guest_gpus == m.GuestGpus(
        expected=2, pci=2, driver=2, driver_state="loaded", driver_version="580.159.04", driver_strategy="preinstalled"
    )
    assert disks[0].read_bytes()[: len(IMAGE_PATTERN)] == IMAGE_PATTERN
    # The host's terminal relay key is authorised in the guest for the console user alone, no sudo (issue 26,
    # point 8; issue 38, point 7): the slice terminal logs in with it.
    _label, seed_files, _joliet = read_seed_iso(env.root / "var/lib/gpuaas/seeds" / f"{prov.vm_name}.iso")
    assert env.agent.provision.relay_public_key and env.agent.provision.relay_public_key in seed_files["user-data"]
    holders = [
        u["name"]
        for u in yaml.safe_load(seed_files["user-data"])["users"]
        if isinstance(u, dict) and env.agent.provision.relay_public_key in u.get("ssh_authorized_keys", [])
    ]
    assert holders == [env.agent.provision.console_user]
    assert await env.libvirt.exists(prov.vm_name)
    xml = ET.fromstring(env.libvirt._connection().lookupByName(prov.vm_name).XMLDesc())
    sources = [s.get("file") or s.get("dev") for s in xml.iter("source") if s.get("file") or s.get("dev")]
    # The domain names its disks by the stable by-id path, never by a kernel name.
    assert str(env.root / prov.slots[0].nvme_by_id.lstrip("/")) in sources
    await env.spy.wait_type("node.task_result", task_id=prov.task_id)
    phases = [e["payload"]["phase"] for e in env.spy.of_type("node.task_progress", task_id=prov.task_id)]
    # The reservation comes before the domain exists, so the guest's first DHCP request finds its address.
    assert phases == [
        "preflight",
        "seed",
        "clone_image",
        "dhcp_reservation",
        "define",
        "isolate",
        "wait_ready",
        "ready",
    ]
    # The slice's OVS port is protected: slices on the host never reach each other.
    assert (env.root / "var/lib/gpuaas-fixture/ovs-protected.txt").read_text().split() == [tap_name(prov.vm_name)]

    leases = env.root / "var/lib/misc/dnsmasq.leases"
    assert prov.slots[0].mac in leases.read_text()
    rel = env.release(prov)
    released = await env.agent.execute("slice.vm_release", rel)
    assert released.status == "succeeded", released
    assert released.stop_path == "graceful"
    assert prov.slots[0].mac not in leases.read_text()  # dnsmasq was told to forget the lease (dhcp_release)
    assert [p.device for p in released.wipe_proofs] == [s.nvme_by_id for s in prov.slots]
    assert all(p.verified and p.signatures == [] for p in released.wipe_proofs)
    assert all(d.read_bytes() == bytes(d.stat().st_size) for d in disks)
    assert not await env.libvirt.exists(prov.vm_name)
    assert not (env.root / "etc/gpuaas/dnsmasq-hosts" / prov.vm_name).exists()
    assert env.agent.store.leased_resources() == {}


async def _failed_after_boot(env: Env, task: m.SliceVmProvision, code: str) -> m.NodeTaskResult:
    """A provision that failed its readiness: the ordinary failure cleanup, as for any failure after the clone."""
    result = await env.agent.execute("slice.vm_provision", task)
    assert (result.status, result.reason_code) == ("failed", code), result
    assert (result.cleanup_required, result.disk_touched) == (True, True)
    assert result.readiness is None
    assert not await env.libvirt.exists(task.vm_name)
    assert not (env.root / "etc/gpuaas/dnsmasq-hosts" / task.vm_name).exists()
    # The disks hold the clone: their leases stay until a release has wiped them.
    leased = env.agent.store.leased_resources()
    assert all(f"nvme:{s.nvme_by_id}" in leased for s in task.slots)
    return result


async def test_a_guest_missing_a_gpu_fails_readiness_and_is_cleaned_up(env: Env) -> None:
    prov = env.provision(env.slots[:2])
    env.guests.faults[prov.vm_name] = GuestFault(missing_gpus=1)
    result = await _failed_after_boot(env, prov, "guest_gpu_mismatch")
    assert result.reason == "the slot group passes 2 GPU(s) through; the guest sees 1 on its PCI bus (0000:00:06.0)"
    await env.spy.wait_type("node.task_result", task_id=prov.task_id)
    assert "ready" not in [e["payload"]["phase"] for e in env.spy.of_type("node.task_progress", task_id=prov.task_id)]
    # The ordinary release wipes the disks and frees the leases.
    released = await env.agent.execute("slice.vm_release", env.release(prov))
    assert released.status == "succeeded" and all(p.verified for p in released.wipe_proofs)
    assert env.agent.store.leased_resources() == {}


async def test_the_driver_strategy_decides_whether_a_guest_without_a_driver_is_ready(env: Env) -> None:
    preinstalled = env.provision(env.slots[:1])
    env.guests.faults[preinstalled.vm_name] = GuestFault(driver="absent")
    result = await _failed_after_boot(env, preinstalled, "guest_gpu_driver_missing")
    assert result.reason == "the image's driver is preinstalled, but in the guest nvidia-smi is absent: " + (
        "nvidia-smi is not installed"
    )
    assert (await env.agent.execute("slice.vm_release", env.release(preinstalled))).status == "succeeded"

    # The same guest from an image whose driver cloud-init installs: its GPU is there, so it is ready.
    later = env.provision(env.slots[:1])
    later = later.model_copy(update={"image": later.image.model_copy(update={"driver_strategy": "cloud_init"})})
    env.guests.faults[later.vm_name] = GuestFault(driver="absent")
    ok = await env.agent.execute("slice.vm_provision", later)
    assert ok.status == "succeeded", ok
    assert ok.readiness and ok.readiness.guest_gpus == m.GuestGpus(
        expected=1, pci=1, driver=None, driver_state="absent", driver_strategy="cloud_init"
    )


async def test_a_guest_that_never_reports_its_gpus_is_not_ready(tmp_path: Path, publish, spy) -> None:
    async for env in _make_env(tmp_path, publish, spy, readiness_timeout_s=1.5):
        prov = env.provision(env.slots[:1])
        env.guests.faults[prov.vm_name] = GuestFault(no_report=True)
        result = await _failed_after_boot(env, prov, "guest_report_missing")
        assert "the guest did not report its GPUs within 2s" in (result.reason or "")


async def test_duplicated_task_is_answered_from_its_record_not_run_again(env: Env) -> None:
    prov = env.provision(env.slots[:1])
    first = await env.agent.execute("slice.vm_provision", prov)
    assert first.status == "succeeded"
    disk = env.disk(prov.slots[0].nvme_by_id)
    before = _digest(disk)
    disk.write_bytes(b"\x01" * disk.stat().st_size)  # a rerun would clone over this
    again = await env.agent.execute("slice.vm_provision", prov)
    assert again == first
    assert _digest(disk) != before and disk.read_bytes()[:1] == b"\x01"


# --- refusals before anything destructive ------------------------------------------------------------------


async def _refused(env: Env, task: m.SliceVmProvision, code: str) -> m.NodeTaskResult:
    disks = {s.nvme_by_id: env.disk(s.nvme_by_id) for s in task.slots}
    sums = {k: _fill(p) for k, p in disks.items()}
    result = await env.agent.execute("slice.vm_provision", task)
    assert (result.status, result.reason_code) == ("refused", code), result
    # Said outright, from the task's record: the one case in which the slots may return without a wipe.
    assert (result.cleanup_required, result.disk_touched) == (False, False)
    assert {k: _digest(p) for k, p in disks.items()} == sums, "a refused task touched a disk"
    assert not await env.libvirt.exists(task.vm_name)
    phases = [e["payload"]["phase"] for e in env.spy.of_type("node.task_progress", task_id=task.task_id)]
    assert "clone_image" not in phases
    return result


async def test_mounted_child_disk_is_refused(env: Env) -> None:
    slot = env.slots[7].model_copy(update={"nvme_by_id": env.by_id("nvme8n1")})
    result = await _refused(env, env.provision([slot]), "disk_child_mounted")
    assert "nvme8n1p1" in (result.reason or "") and "/share8" in (result.reason or "")


async def test_os_disk_is_refused(env: Env) -> None:
    slot = env.slots[3].model_copy(update={"nvme_by_id": env.by_id("nvme4n1")})
    await _refused(env, env.provision([slot]), "disk_is_os_disk")


async def test_mounted_whole_disk_is_refused(tmp_path: Path, publish, spy) -> None:
    async for e in _make_env(tmp_path, publish, spy):
        mounts = e.root / "proc/mounts"
        mounts.write_text(mounts.read_text() + "/dev/nvme2n1 /scratch xfs rw 0 0\n")
        await _refused(e, e.provision([e.slots[2]]), "disk_mounted")


async def test_kernel_name_instead_of_by_id_is_refused(env: Env) -> None:
    slot = env.slots[0].model_copy(update={"nvme_by_id": "/dev/nvme0n1"})
    task = env.provision([slot])
    result = await env.agent.execute("slice.vm_provision", task)
    assert (result.status, result.reason_code) == ("refused", "disk_identity_unstable")


async def test_gpu_already_leased_is_refused(env: Env) -> None:
    first = await env.agent.execute("slice.vm_provision", env.provision([env.slots[0]]))
    assert first.status == "succeeded"
    # Same GPU, another (free) disk: only the agent's own lease stops it, libvirt's test driver would not.
    clash = env.slots[1].model_copy(update={"gpu_pci_address": env.slots[0].gpu_pci_address})
    result = await _refused(env, env.provision([clash]), "resource_leased")
    assert env.slots[0].gpu_pci_address in (result.reason or "")


async def test_stale_fencing_epoch_is_refused(env: Env) -> None:
    newer = env.provision([env.slots[0]], epoch=5)
    assert (await env.agent.execute("slice.vm_provision", newer)).status == "succeeded"
    assert (await env.agent.execute("slice.vm_release", env.release(newer))).status == "succeeded"
    stale = env.provision([env.slots[0]], epoch=3)
    result = await _refused(env, stale, "stale_epoch")
    assert "epoch 5" in (result.reason or "")


async def test_a_live_vm_is_released_after_a_refused_newer_claim_raised_the_fence(env: Env) -> None:
    # The scheduler lost the live VM's claim (a Postgres commit lost) and placed its slot again at a newer epoch:
    # the newer provision is refused on the lease, and the VM's own release must still tear it down.
    live = env.provision([env.slots[0]], epoch=3)
    assert (await env.agent.execute("slice.vm_provision", live)).status == "succeeded"
    await _refused(env, env.provision([env.slots[0]], epoch=5), "resource_leased")
    assert (await env.agent.execute("slice.vm_release", env.release(live))).status == "succeeded"
    assert not await env.agent.libvirt.exists(live.vm_name)
    # The fence holds for anyone else: an epoch older than 5 that holds no lease is refused.
    await _refused(env, env.provision([env.slots[0]], epoch=4), "stale_epoch")


async def test_unverified_image_is_refused(env: Env) -> None:
    await _refused(env, env.provision([env.slots[0]], digest="0" * 64), "image_unverified")


async def test_passed_deadline_is_refused(env: Env) -> None:
    await _refused(env, env.provision([env.slots[0]], deadline_s=-1), "deadline_passed")


@pytest.mark.parametrize(
    ("host", "code"),
    [
        ({"kvm": False}, "host_not_ready"),
        ({"iommu_groups": False}, "host_not_ready"),
        ({"vfio_modules": False}, "host_not_ready"),
        ({"ovs_bridge": None}, "ovs_bridge_missing"),
        ({"hugepages_1g_free": 32}, "hugepages_insufficient"),
        # managed='no' domains: a device off vfio-pci or held by a host GPU service refuses the task.
        ({"nvidia_bound_gpus": 1}, "device_not_vfio"),
        ({"nvidia_persistenced_active": True}, "host_gpu_services_active"),
        ({"fabricmanager_mode": 0}, "host_gpu_services_active"),
    ],
)
async def test_host_preflight_refuses_before_the_disk(tmp_path: Path, publish, spy, host, code) -> None:
    async for e in _make_env(tmp_path, publish, spy, **host):
        await _refused(e, e.provision([e.slots[0]]), code)


# --- bounded runtime, failures after the disk, release paths ------------------------------------------------


async def test_deadline_bounds_the_runtime_and_cleans_up_the_domain(tmp_path: Path, publish, spy) -> None:
    async for e in _make_env(tmp_path, publish, spy, dhcp=False):
        task = e.provision([e.slots[0]], deadline_s=3)
        result = await e.agent.execute("slice.vm_provision", task)
        assert (result.status, result.reason_code, result.cleanup_required) == ("failed", "deadline_exceeded", True)
        assert result.disk_touched
        assert not await e.libvirt.exists(task.vm_name)
        assert not (e.root / "etc/gpuaas/dnsmasq-hosts" / task.vm_name).exists()
        # The disk was touched: its leases stay until a release has wiped it.
        assert f"nvme:{task.slots[0].nvme_by_id}" in e.agent.store.leased_resources()


async def test_release_hard_stops_a_guest_that_ignores_the_power_button(tmp_path: Path, publish, spy) -> None:
    async for e in _make_env(tmp_path, publish, spy, shutdown_timeout_s=0.3):
        prov = e.provision([e.slots[0]])
        assert (await e.agent.execute("slice.vm_provision", prov)).status == "succeeded"
        conn = e.libvirt._connection()
        dom = conn.lookupByName(prov.vm_name)
        root = ET.fromstring(dom.XMLDesc())
        root.find("on_poweroff").text = "restart"
        dom.destroy()
        conn.defineXML(ET.tostring(root, encoding="unicode")).create()
        rel = e.release(prov)
        result = await e.agent.execute("slice.vm_release", rel)
        assert result.status == "succeeded" and all(p.verified for p in result.wipe_proofs)
        undefine = e.spy.of_type("node.task_progress", task_id=rel.task_id, phase="undefine")
        assert undefine and undefine[0]["payload"]["detail"] == "stop path: forced"
        assert not await e.libvirt.exists(prov.vm_name)


async def test_release_refuses_to_wipe_a_disk_mounted_since_provision(env: Env) -> None:
    prov = env.provision([env.slots[1]])
    assert (await env.agent.execute("slice.vm_provision", prov)).status == "succeeded"
    disk = env.disk(prov.slots[0].nvme_by_id)
    before = _digest(disk)
    name = disk.name
    mounts = env.root / "proc/mounts"
    mounts.write_text(mounts.read_text() + f"/dev/{name} /mnt/oops ext4 rw 0 0\n")
    result = await env.agent.execute("slice.vm_release", env.release(prov))
    assert (result.status, result.reason_code, result.cleanup_required) == ("refused", "disk_mounted", True)
    assert _digest(disk) == before
    assert f"nvme:{prov.slots[0].nvme_by_id}" in env.agent.store.leased_resources()


# --- restart: recovery and reconciliation ---------------------------------------------------------------


async def test_recovery_reruns_a_task_interrupted_before_the_disk(env: Env) -> None:
    task = env.provision([env.slots[2]])
    # What a killed agent leaves behind after preflight: a running record, nothing destructive yet.
    env.agent.store.start_task(
        task.task_id,
        "slice.vm_provision",
        str(task.allocation_id),
        vm_name=task.vm_name,
        payload=task.model_dump(mode="json"),
    )
    env.agent.store.set_phase(task.task_id, "preflight")
    results = await env.agent.recover()
    assert [(r.task_id, r.status) for r in results] == [(task.task_id, "succeeded")]
    result = await env.spy.wait_type("node.task_result", task_id=task.task_id)
    assert result["payload"]["status"] == "succeeded"


def _interrupted(env: Env, task: m.SliceVmProvision, phase: str = "wait_ready") -> None:
    """What a killed agent leaves behind once it has written the disk: a running record past the clone."""
    env.agent.store.start_task(
        task.task_id,
        "slice.vm_provision",
        str(task.allocation_id),
        vm_name=task.vm_name,
        payload=task.model_dump(mode="json"),
    )
    env.agent.store.check_and_record_epochs([s.slot_id for s in task.slots], task.fencing_epoch)
    env.agent.store.set_phase(task.task_id, "clone_image", disk_touched=True)
    env.agent.store.set_phase(task.task_id, phase)


async def test_recovery_resumes_a_provision_interrupted_after_the_disk(env: Env) -> None:
    task = env.provision([env.slots[3]])
    _interrupted(env, task)
    results = await env.agent.recover()
    assert [(r.status, r.reason_code, r.cleanup_required) for r in results] == [("succeeded", None, False)]
    assert await env.libvirt.exists(task.vm_name)
    # A redelivery of the same task afterwards gets the same answer.
    assert await env.agent.execute("slice.vm_provision", task) == results[0]


async def test_recovery_resumes_even_when_the_domain_was_already_defined(env: Env) -> None:
    task = env.provision([env.slots[5]])
    assert (await env.agent.execute("slice.vm_provision", task)).status == "succeeded"
    # Killed between define and the result: the domain exists and the record is still running.
    env.agent.store._db.execute(
        "UPDATE tasks SET status = 'running', result_json = NULL WHERE task_id = ?", (task.task_id,)
    )
    results = await env.agent.recover()
    assert [(r.status, r.reason_code) for r in results] == [("succeeded", None)]


async def test_recovery_wipes_with_proof_a_provision_that_cannot_resume(env: Env) -> None:
    task = env.provision([env.slots[6]], deadline_s=-1)
    disk = env.disk(task.slots[0].nvme_by_id)
    _fill(disk)
    _interrupted(env, task)
    results = await env.agent.recover()
    [r] = results
    # The agent wiped the disk, yet the result says it was touched: the slot returns only if the scheduler finds
    # the proof to satisfy the site's policy, never on the agent's word (before, it said untouched: no cleanup).
    assert (r.status, r.reason_code, r.disk_touched) == ("failed", "deadline_passed", True)
    assert not r.cleanup_required  # nothing left for ops: the wipe it owed is done and proven
    assert [(p.device, p.verified) for p in r.wipe_proofs] == [(task.slots[0].nvme_by_id, True)]
    assert disk.read_bytes() == bytes(disk.stat().st_size)
    assert not any(a == str(task.allocation_id) for a in env.agent.store.leased_resources().values())


async def test_recovery_never_wipes_a_disk_a_newer_claim_owns(env: Env) -> None:
    task = env.provision([env.slots[7]])
    disk = env.disk(task.slots[0].nvme_by_id)
    _interrupted(env, task)
    # While the agent was down the slot was fenced by a newer claim: its disk is not this task's any more.
    env.agent.store.check_and_record_epochs([task.slots[0].slot_id], task.fencing_epoch + 1)
    before = _digest(disk)
    [r] = await env.agent.recover()
    assert (r.status, r.reason_code, r.wipe_proofs) == ("refused", "stale_epoch", [])
    assert _digest(disk) == before


async def test_recovery_reports_cleanup_when_the_wipe_cannot_be_done(env: Env) -> None:
    task = env.provision([env.slots[0]], deadline_s=-1)
    _interrupted(env, task)
    disk = env.disk(task.slots[0].nvme_by_id)
    mounts = env.root / "proc/mounts"
    mounts.write_text(mounts.read_text() + f"/dev/{disk.name} /mnt/oops ext4 rw 0 0\n")
    [r] = await env.agent.recover()
    assert (r.status, r.reason_code, r.cleanup_required, r.disk_touched) == ("failed", "deadline_passed", True, True)
    assert "wipe not verified" in (r.reason or "")


async def test_reconcile_removes_domains_of_failed_provisions_and_leaves_unknown_ones(env: Env) -> None:
    task = env.provision([env.slots[4]])
    assert (await env.agent.execute("slice.vm_provision", task)).status == "succeeded"
    # Leftover from a failed attempt: the record says failed, yet the domain is still defined.
    env.agent.store.finish_task(task.task_id, "failed", {})
    foreign = ET.fromstring(env.libvirt._connection().lookupByName(task.vm_name).XMLDesc())
    foreign.find("name").text = "it-not-ours"
    foreign.find("uuid").text = str(uuid.uuid4())
    env.libvirt._connection().defineXML(ET.tostring(foreign, encoding="unicode"))
    await env.agent.reconcile_domains()
    assert not await env.libvirt.exists(task.vm_name)
    assert await env.libvirt.exists("it-not-ours")


async def test_discover_task_publishes_topology_and_parity(env: Env) -> None:
    from gpuaas_common.bus import HandlerContext

    task = m.SliceTopologyDiscover(
        task_id=f"disc-{uuid.uuid4().hex[:8]}", node_id=env.node_id, deadline=utcnow() + timedelta(seconds=30)
    )
    envelope = Envelope.wrap(
        "slice.topology_discover", task.model_dump(mode="json"), producer="ops", correlation_id=task.task_id
    )
    await env.agent.on_discover(HandlerContext(envelope, task, "s", "c", 1))
    topo = await env.spy.wait_type("node.topology_reported", task_id=task.task_id)
    parity = await env.spy.wait_type("node.parity_reported", task_id=task.task_id)
    assert sum(s["complete"] for s in topo["payload"]["candidate_slots"]) == 7
    assert parity["payload"]["failures"] == 0
    node_agent = next(c for c in parity["payload"]["checks"] if c["check"] == "node_agent")
    assert node_agent["detail"] == "reporting"
    # The host's 1 GiB hugepages are capability evidence in the same report (the fixture's 512 staged pages).
    assert (topo["payload"]["hugepages_1g_total"], topo["payload"]["hugepages_1g_free"]) == (512, 512)


@pytest.mark.parametrize(
    ("host", "reported"),
    [
        ({"hugepages_1g_total": 512, "hugepages_1g_free": 448}, (512, 448)),
        ({"hugepages_1g_total": 0}, (0, 0)),
        ({"hugepages_1g_total": None}, (0, 0)),
    ],
)
async def test_published_topology_carries_the_hosts_hugepages(tmp_path: Path, publish, spy, host, reported) -> None:
    async for e in _make_env(tmp_path, publish, spy, **host):
        topology, _ = await e.agent.report_host_state(task_id=f"hp-{uuid.uuid4().hex[:8]}")
        published = await e.spy.wait_type("node.topology_reported", task_id=topology.task_id)
        assert (published["payload"]["hugepages_1g_total"], published["payload"]["hugepages_1g_free"]) == reported


async def test_reconciler_sweeps_orphaned_reservations_and_reports_drift(env: Env) -> None:
    from gpuaas_node_agent.adapters import dnsmasq

    live = env.provision([env.slots[1]])
    assert (await env.agent.execute("slice.vm_provision", live)).status == "succeeded"
    dead = env.provision([env.slots[2]])
    assert (await env.agent.execute("slice.vm_provision", dead)).status == "succeeded"
    assert (await env.agent.execute("slice.vm_release", env.release(dead))).status == "succeeded"
    # Left behind by a crash between undefine and the reservation's removal, and one written by hand.
    dnsmasq.write_reservation(env.agent.hostsdir, dead.vm_name, "52:54:00:aa:00:01", "127.101.1.99", "dead-vm")
    dnsmasq.write_reservation(env.agent.hostsdir, "by-hand", "52:54:00:aa:00:02", "127.101.1.98", "ops-vm")
    env.agent.store.take_leases(["gpu:0000:ff:00.0"], "no-such-allocation")
    drift = await env.agent.reconcile_host()
    kinds = {(d.kind, d.subject, d.swept) for d in drift}
    assert ("dhcp_reservation_orphaned", dead.vm_name, True) in kinds
    assert ("dhcp_reservation_orphaned", "by-hand", False) in kinds
    assert ("lease_orphaned", "gpu:0000:ff:00.0", False) in kinds
    reservations = dnsmasq.read_reservations(env.agent.hostsdir)
    assert dead.vm_name not in reservations and "by-hand" in reservations and live.vm_name in reservations
    assert not any(d.subject == live.vm_name for d in drift)
    # The live VM's domain vanishing behind the agent's back is drift too.
    await env.libvirt.shutdown(live.vm_name, 0)
    await env.libvirt.undefine(live.vm_name)
    drift = await env.agent.reconcile_host()
    assert ("domain_missing", live.vm_name) in {(d.kind, d.subject) for d in drift}


@pytest.mark.parametrize("policy", ["blkdiscard", "nvme_format", "crypto_erase"])
async def test_release_wipes_by_the_site_policy_the_slots_carry(env: Env, policy: str) -> None:
    slots = [s.model_copy(update={"wipe_policy": policy}) for s in env.slots[:1]]
    prov = env.provision(slots)
    assert (await env.agent.execute("slice.vm_provision", prov)).status == "succeeded"
    released = await env.agent.execute("slice.vm_release", env.release(prov))
    assert released.status == "succeeded", released
    [proof] = released.wipe_proofs
    assert (proof.device, proof.method, proof.verified) == (slots[0].nvme_by_id, policy, True)
    assert proof.verification and "read-back" in proof.verification
    # The published result (validated against the contract by the spy) carries the same proof.
    published = await env.spy.wait_type("node.task_result", task_id=released.task_id)
    assert published["payload"]["wipe_proofs"][0]["method"] == policy


async def test_a_progress_publish_that_times_out_does_not_fail_the_task(tmp_path: Path, publish, spy) -> None:
    """While a stream elects a new leader a JetStream publish times out; that timeout once surfaced as the
    task's `deadline_exceeded` (a cluster run failed a provision 20 minutes before its deadline)."""

    async def flaky(type_: str, payload: Any, **kw: Any) -> Envelope:
        if type_ == "node.task_progress":
            raise nats.errors.TimeoutError
        return await publish(type_, payload, **kw)

    async for e in _make_env(tmp_path, flaky, spy):
        prov = e.provision(e.slots[:1])
        result = await e.agent.execute("slice.vm_provision", prov)
        assert result.status == "succeeded", result
        released = await e.agent.execute("slice.vm_release", e.release(prov))
        assert released.status == "succeeded", released


async def test_a_task_asked_again_is_answered_again_under_a_new_message_id(env: Env) -> None:
    """The control plane lost its commit of the answer and asks again: the agent answers from its record, and
    under an id of its own — under the first answer's id JetStream would drop the answer as a duplicate and
    the allocation would wait until its deadline (chaos run: active, commit lost, re-asked, failed)."""
    prov = env.provision(env.slots[:1])
    first = await env.agent.execute("slice.vm_provision", prov, causation_id="task-message-1")
    again = await env.agent.execute("slice.vm_provision", prov, causation_id="task-message-2")
    assert again == first
    redelivered = await env.agent.execute("slice.vm_provision", prov, causation_id="task-message-2")
    assert redelivered == first

    def answers() -> list[dict[str, Any]] | None:
        found = env.spy.of_type("node.task_result", task_id=prov.task_id)
        return found if len(found) >= 3 else None

    found = await env.spy.wait_for(answers, what="three answers")
    ids = [e["event_id"] for e in found]
    assert ids[0] != ids[1], "the answer to the second asking has a new id"
    assert ids[1] == ids[2], "a redelivery of the same asking is answered under the same id (deduplicated)"


# --- slice.slot_wipe: the scheduler asks, the host proves (issue 38, point 1) ----------------------------------


async def test_a_slot_wipe_zeroes_each_free_disk_and_refuses_a_leased_one_on_the_hosts_report_subject(env: Env) -> None:
    from gpuaas_common.bus import HandlerContext

    # A live allocation leases slot 0's disk; slot 1's disk holds a previous tenant's marker.
    prov = env.provision(env.slots[:1])
    assert (await env.agent.execute("slice.vm_provision", prov)).status == "succeeded"
    free = env.slots[1]
    _fill(env.disk(free.nvme_by_id))
    task = m.SliceSlotWipe(
        task_id=f"wipe-{uuid.uuid4().hex[:8]}",
        node_id=env.node_id,
        deadline=utcnow() + timedelta(seconds=60),
        slots=[
            m.WipeSlot(slot_id=s.slot_id, nvme_by_id=s.nvme_by_id, wipe_policy="blkdiscard")
            for s in (env.slots[0], free)
        ],
    )
    envelope = Envelope.wrap("slice.slot_wipe", task.model_dump(mode="json"), producer="scheduler", correlation_id="w")
    await env.agent.on_slot_wipe(HandlerContext(envelope, task, "s", "c", 1))
    report = await env.spy.wait_type("node.slot_wipe_reported", task_id=task.task_id)
    # The report travels on this host's own report subject: the only one its identity may publish on.
    subjects = {subj for subj, e in env.spy.messages if e.get("type") == "node.slot_wipe_reported"}
    assert subjects == {f"gpuaas.node.{env.node_id}.report.slot_wipe"}
    leased, wiped = report["payload"]["outcomes"]
    assert (leased["slot_id"], leased["reason_code"], leased["proof"]) == (env.slots[0].slot_id, "disk_leased", None)
    assert wiped["slot_id"] == free.slot_id and wiped["proof"]["verified"] and wiped["proof"]["signatures"] == []
    assert MARKER not in env.disk(free.nvme_by_id).read_bytes()
    # The leased disk still holds the tenant's VM's image: nothing was written to it.
    assert env.disk(env.slots[0].nvme_by_id).read_bytes()[: len(IMAGE_PATTERN)] == IMAGE_PATTERN
