"""The lab's failure paths and the production domain XML, on the production agent in the lab's namespace (QEMU/TCG
under the lab's own libvirtd, tasks and results over a real nats-server forwarded into the namespace through a
unix socket). The happy path, one slice allocated through the whole stack onto a real VM and back, is
test_lab_allocation.py.

A guest with no operating system shows the failure paths without a boot: no lease (`lease_timeout`, everything
cleaned) and a guest deaf to ACPI (stopped hard, and the release says so). The production XML (GPU and VF
hostdevs, kvm, hugepages, OVS) passes libvirt's schema and is defined, never started. Every message on
`gpuaas.>` is checked against the contract.

These tests run wherever the lab's pieces are installed (`scripts/setup.sh` installs them) and the process may
make a network namespace; where that holds they fail, never skip, when the lab does not work.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from gpuaas_common.jetstream import provision
from gpuaas_dev.lab import preflight
from gpuaas_dev.lab.agent import LabAgentConfig, image_cache_dir, start_agent, stop_agent
from gpuaas_dev.lab.lab import Lab, LabState
from gpuaas_dev.lab.tasks import provision_task, release_task, send
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.servers import NatsServer
from gpuaas_node_agent.domain.domain_xml import render_domain_xml
from gpuaas_node_agent.domain.vm_spec import SliceVmSpec

from .lab_checks import domains, lab_only, run, virsh

pytestmark = lab_only  # why this is no skip left to rot: lab_checks.lab_only

NODE = "lab-host-1"
BOOT_S = 600.0


@pytest.fixture(scope="module")
def lab(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory):
    made = Lab(tmp_path_factory.mktemp("lab"), slots=1)
    made.up(forwards={"nats": nats_server.port})
    try:
        yield made
    finally:
        problems = made.down()
        assert problems == []


@pytest.fixture(scope="module")
async def bus(nats_server: NatsServer) -> AsyncIterator[Any]:
    nc = await nats.connect(nats_server.url)
    await provision(nc.jetstream())
    spy = await BusSpy(nats_server.url).start()
    yield nc, spy
    await spy.stop()
    await nc.drain()
    assert spy.violations == []


async def _result(spy: BusSpy, task_id: str, timeout: float) -> dict[str, Any]:
    env = await spy.wait_type("node.task_result", task_id=task_id, timeout=timeout)
    return env["payload"]


async def _agent(lab: Lab, nats_server: NatsServer, spy: BusSpy, *, wait: bool = True, **env: str) -> None:
    enrolled = len(spy.of_type("node.enrolled"))
    start_agent(lab, LabAgentConfig(node_id=NODE, nats_url=nats_server.url, extra_env=env))
    if not wait:
        return

    await spy.wait_for(lambda: len(spy.of_type("node.enrolled")) > enrolled, 120, "the lab agent's enrolment")


@pytest.mark.timeout(600)
async def test_a_guest_that_never_boots_fails_with_lease_timeout_and_leaves_nothing(
    lab: Lab, nats_server: NatsServer, bus, tmp_path: Path
):
    """A guest with no operating system: OVMF finds nothing to boot, so no DHCP request ever comes (the
    provision fails with lease_timeout and cleans up), and nothing answers ACPI (a release stops it hard)."""
    nc, spy = bus
    st = lab.state
    assert st is not None
    blank = image_cache_dir(lab) / "blank.raw"
    with blank.open("wb") as f:
        f.truncate(64 << 20)
    digest = run(["sha256sum", str(blank)]).stdout.split()[0]
    image = {"slug": "blank", "digest_sha256": digest, "image_path": str(blank)}
    stop_agent(lab, NODE)
    await _agent(lab, nats_server, spy, GPUAAS_READINESS_TIMEOUT_S="45", GPUAAS_SHUTDOWN_TIMEOUT_S="10")
    key = tmp_path / "k"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
    prov = provision_task(st, NODE, image, [key.with_suffix(".pub").read_text().strip()], epoch=2)
    await send(nc, "slice.vm_provision", prov)
    result = await _result(spy, prov["task_id"], 300)
    assert result["status"] == "failed" and result["reason_code"] == "lease_timeout", result
    assert result["cleanup_required"]  # the image was written to the disk: only a wipe frees the slot
    assert domains(st) == []
    assert not (Path(st.hostsdir) / prov["vm_name"]).exists()

    # The same deaf guest, defined by hand and left running, is stopped hard by a release.
    rel = release_task({**prov, "fencing_epoch": 2})
    started = await _start_deaf_guest(lab, st, prov)
    assert started
    await send(nc, "slice.vm_release", rel)
    released = await _result(spy, rel["task_id"], 300)
    assert released["status"] == "succeeded", released
    stopped = spy.of_type("node.task_progress", task_id=rel["task_id"], phase="undefine")
    assert stopped and stopped[0]["payload"]["detail"] == "stop path: forced"
    assert released["stop_path"] == "forced"  # what the allocation's timeline records (vm_stopped_hard)
    assert domains(st) == []


async def _start_deaf_guest(lab: Lab, st: LabState, prov: dict[str, Any]) -> bool:
    """Define and start a domain like the agent's (same name, disk, bridge, firmware) with no OS on its disk."""
    slot = st.slots[0]
    xml = f"""<domain type='qemu'>
  <name>{prov["vm_name"]}</name><memory unit='MiB'>256</memory><vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type>
    <loader readonly='yes' type='pflash'>{preflight.OVMF_CODE}</loader>
    <nvram template='{preflight.OVMF_VARS}'/></os>
  <features><acpi/><apic/></features>
  <devices>
    <disk type='block' device='disk'><driver name='qemu' type='raw'/><source dev='{slot.by_id}'/>
      <target dev='vda' bus='virtio'/></disk>
    <interface type='bridge'><mac address='{slot.mac}'/><source bridge='{st.bridge}'/><model type='virtio'/></interface>
  </devices>
</domain>"""
    path = Path(lab.root) / "deaf.xml"
    path.write_text(xml)
    return virsh(st, "define", str(path)).returncode == 0 and virsh(st, "start", prov["vm_name"]).returncode == 0


async def test_the_production_xml_with_gpu_and_vf_hostdevs_validates_and_defines(lab: Lab) -> None:
    """What a GPU host gets (kvm, host CPU, hugepages, two GPUs and a fabric VF passed through, OVS): valid for
    libvirt's schema and accepted by a real QEMU driver's define. Never started: the lab has no such devices."""
    st = lab.state
    assert st is not None
    spec = SliceVmSpec(
        vm_name=f"prod-xml-{uuid.uuid4().hex[:8]}",
        uuid=str(uuid.uuid4()),
        vcpus=48,
        memory_mib=128 * 1024,
        hugepages=True,
        numa_node=0,
        cpuset="0-23,96-119",
        gpus=["0000:18:00.0", "0000:3b:00.0"],
        fabric_vfs=["0000:29:00.2"],
        nvme_by_id=["/dev/disk/by-id/nvme-eui.0025388b91c2a1f1"],
        seed_iso_path="/var/lib/gpuaas/seeds/vm.iso",
        mac="52:54:00:ab:cd:01",
        bridge="ovsbr0",
    )
    xml = Path(lab.root) / "prod.xml"
    xml.write_text(render_domain_xml(spec))
    valid = run(["virt-xml-validate", str(xml), "domain"])
    assert valid.returncode == 0, valid.stderr
    defined = virsh(st, "define", str(xml))
    assert defined.returncode == 0, defined.stderr
    try:
        dumped = virsh(st, "dumpxml", spec.vm_name).stdout
        assert dumped.count("<hostdev ") == 3 and "type='kvm'" in dumped
    finally:
        assert virsh(st, "undefine", "--nvram", spec.vm_name).returncode == 0
    assert spec.vm_name not in domains(st)
