"""LibvirtHost against libvirt's in-process test driver: the whole VM lifecycle, no daemon."""

from __future__ import annotations

import uuid
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator

import pytest

from gpuaas_node_agent.adapters.libvirt_host import DomainState, LibvirtHost, LibvirtHostError, ShutdownPath
from gpuaas_node_agent.domain.domain_xml import render_domain_xml
from gpuaas_node_agent.domain.vm_spec import SliceVmSpec


@pytest.fixture
def names() -> list[str]:
    return []


@pytest.fixture
async def host(names: list[str]) -> AsyncIterator[LibvirtHost]:
    # test:///default state is shared by connections open at once in this process: one host object per test,
    # unique domain names, and every domain removed afterwards.
    h = LibvirtHost("test:///default", poll_interval_s=0.02)
    yield h
    for name in names:
        if await h.exists(name):
            await h.shutdown(name, 0)
            await h.undefine(name)
    await h.close()


def _xml(names: list[str], *, restart_on_poweroff: bool = False) -> tuple[str, str]:
    name = f"it-slice-{uuid.uuid4().hex[:10]}"
    names.append(name)
    spec = SliceVmSpec(
        vm_name=name,
        uuid=str(uuid.uuid4()),
        vcpus=2,
        memory_mib=1024,
        hugepages=True,
        numa_node=0,
        cpuset="0-1",
        gpus=["0000:18:00.0"],
        fabric_vfs=["0000:29:00.2"],
        nvme_by_id=["/dev/disk/by-id/nvme-eui.00aa"],
        seed_iso_path="/var/lib/gpuaas/seeds/x.iso",
        mac="52:54:00:00:00:01",
    )
    root = ET.fromstring(render_domain_xml(spec))
    if restart_on_poweroff:
        # A guest that ignores the ACPI power button: only destroy() stops it.
        root.find("on_poweroff").text = "restart"
    return name, ET.tostring(root, encoding="unicode")


async def test_define_start_graceful_shutdown_undefine(host: LibvirtHost, names: list[str]) -> None:
    name, xml = _xml(names)
    assert not await host.exists(name)
    assert await host.state(name) is DomainState.ABSENT

    dom_uuid = await host.define_and_start(xml)
    assert uuid.UUID(dom_uuid)
    assert await host.exists(name)
    assert await host.state(name) is DomainState.RUNNING
    listed = {d.name: d for d in await host.list_domains()}
    assert listed[name].uuid == dom_uuid and listed[name].persistent and listed[name].state is DomainState.RUNNING

    assert await host.shutdown(name, timeout_s=5) is ShutdownPath.GRACEFUL
    assert await host.state(name) is DomainState.SHUTOFF
    assert await host.shutdown(name, timeout_s=5) is ShutdownPath.ALREADY_OFF

    # The test driver refuses VIR_DOMAIN_UNDEFINE_NVRAM (code 8): the plain undefine fallback must take over.
    assert await host.undefine(name) is True
    assert not await host.exists(name)
    assert name not in {d.name for d in await host.list_domains()}


async def test_guest_ignoring_shutdown_is_destroyed_after_timeout(host: LibvirtHost, names: list[str]) -> None:
    name, xml = _xml(names, restart_on_poweroff=True)
    await host.define_and_start(xml)
    assert await host.shutdown(name, timeout_s=0.2) is ShutdownPath.FORCED
    assert await host.state(name) is DomainState.SHUTOFF
    assert await host.undefine(name) is True


async def test_undefine_refuses_a_running_domain(host: LibvirtHost, names: list[str]) -> None:
    name, xml = _xml(names)
    await host.define_and_start(xml)
    with pytest.raises(LibvirtHostError, match="running"):
        await host.undefine(name)
    assert await host.state(name) is DomainState.RUNNING


async def test_absent_domain_is_tolerated_by_release_steps(host: LibvirtHost) -> None:
    name = f"it-missing-{uuid.uuid4().hex[:8]}"
    assert await host.shutdown(name, timeout_s=1) is ShutdownPath.ABSENT
    assert await host.undefine(name) is False


async def test_duplicate_name_with_other_uuid_is_an_error(host: LibvirtHost, names: list[str]) -> None:
    name, xml = _xml(names)
    await host.define_and_start(xml)
    root = ET.fromstring(xml)
    root.find("uuid").text = str(uuid.uuid4())
    with pytest.raises(LibvirtHostError) as info:
        await host.define_and_start(ET.tostring(root, encoding="unicode"))
    assert info.value.op == "define" and info.value.code is not None
    assert await host.state(name) is DomainState.RUNNING


async def test_bad_xml_is_a_define_error(host: LibvirtHost) -> None:
    with pytest.raises(LibvirtHostError) as info:
        await host.define_and_start("<domain type='kvm'><name>x</name></domain")
    assert info.value.op == "define"
