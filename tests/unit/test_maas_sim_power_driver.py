"""The simulator's machines behind a power driver: their phases end when the driver says, not on a timer, and a
driver's late answer never moves a machine that went on to another phase."""

from __future__ import annotations

import xml.etree.ElementTree as ET  # noqa: S405 - our own domain XML

from gpuaas_dev.maas_sim.machines import Machine, NodeStatus, Timers
from gpuaas_dev.maas_sim.virsh_power import VirshParams, domain_xml, grub_cfg, seed_iso

T = Timers(deploying=1.0, releasing=1.0, disk_erasing=1.0)


def virsh_machine() -> Machine:
    m = Machine(system_id="abc123", hostname="vm-1")
    m.virsh = VirshParams("qemu:///system", "maas-vm-1", "/d/disk.img", "/d", "gpubr0", "52:54:00:00:00:01")
    return m


def test_a_driven_deploy_waits_for_the_driver_and_ends_where_it_says() -> None:
    m = virsh_machine()
    m.deploy(0.0, T, owner="admin", osystem="custom", distro_series="img", user_data=b"x")
    token = m.phase_token()
    m.advance(1e9, T)
    assert m.status is NodeStatus.DEPLOYING  # no timer ends it
    assert m.finish_phase(5.0, token) is True
    assert m.status is NodeStatus.DEPLOYED


def test_a_driver_failure_is_the_machines_status_message() -> None:
    m = virsh_machine()
    m.deploy(0.0, T, owner="admin", osystem="custom", distro_series="img")
    m.finish_phase(1.0, m.phase_token(), "Failed deployment: no /curtin")
    assert (m.status, m.status_message) == (NodeStatus.FAILED_DEPLOYMENT, "Failed deployment: no /curtin")


def test_a_late_deploy_answer_does_not_touch_a_released_machine() -> None:
    m = virsh_machine()
    m.deploy(0.0, T, owner="admin", osystem="custom", distro_series="img")
    stale = m.phase_token()
    m.release(1.0, T, erase=True, quick_erase=True)
    assert m.finish_phase(2.0, stale) is False
    assert (m.status, m.erase_mode) == (NodeStatus.DISK_ERASING, "quick")
    assert m.finish_phase(3.0, m.phase_token()) is True
    assert (m.status, m.owner) == (NodeStatus.READY, None)


def test_machines_without_a_driver_keep_their_timers() -> None:
    m = Machine(system_id="def456", hostname="bm-1")
    m.deploy(0.0, T, owner="admin", osystem="ubuntu", distro_series="noble")
    m.advance(1.0, T)
    assert m.status is NodeStatus.DEPLOYED


def test_the_seed_carries_the_user_data_bytes_unchanged() -> None:
    import io

    import pycdlib

    raw = b"#cloud-config\nwrite_files: []\n\xff binary tail"
    iso = pycdlib.PyCdlib()
    iso.open_fp(io.BytesIO(seed_iso(raw, b"instance-id: abc\n")))
    out = io.BytesIO()
    iso.get_file_from_iso_fp(out, rr_path="/user-data")
    assert out.getvalue() == raw
    assert iso.pvd.volume_identifier.rstrip() == b"cidata"


def test_the_machine_boots_its_disk_through_uefi_and_grub_with_the_images_arguments() -> None:
    xml = ET.fromstring(domain_xml(virsh_machine().virsh))
    # No kernel handed to QEMU from outside: the firmware boots the disk, GRUB on its ESP loads the image's kernel.
    assert xml.find("os/kernel") is None and xml.find("os/cmdline") is None
    assert xml.find("os/loader").get("type") == "pflash" and xml.find("os/boot").get("dev") == "hd"
    assert xml.find("os/nvram").text == "/d/OVMF_VARS.fd"
    cfg = grub_cfg(["root=LABEL=gpuaas-root", "ro", "intel_iommu=on"])
    assert "search --no-floppy --label --set=root gpuaas-root" in cfg
    assert "linux /boot/vmlinuz root=LABEL=gpuaas-root ro intel_iommu=on" in cfg and "initrd /boot/initrd.img" in cfg
    xml_text = domain_xml(virsh_machine().virsh)
    assert '<source bridge="gpubr0" />' in xml_text and 'model="virtio-scsi"' in xml_text
