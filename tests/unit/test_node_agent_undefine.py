"""Undefining a VM must ask libvirt to remove its NVRAM too: a UEFI guest's NVRAM file left behind
keeps the tenant's boot variables on the host, and a plain undefine of a domain with NVRAM fails on
real qemu (the test driver refuses the flag, so only a recording domain shows which call came first)."""

from __future__ import annotations

import libvirt
import pytest

from gpuaas_node_agent.adapters.libvirt_host import LibvirtHost


class RecordingDomain:
    def __init__(self, refuse_nvram_with: int | None = None) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.refuse_nvram_with = refuse_nvram_with

    def isActive(self) -> bool:  # noqa: N802 - libvirt's name
        return False

    def undefineFlags(self, flags: int) -> None:  # noqa: N802
        self.calls.append(("undefineFlags", flags))
        if self.refuse_nvram_with is not None:
            err = libvirt.libvirtError("refused")
            err.err = (self.refuse_nvram_with, 0, "refused", 0, "", None, None, 0, 0)
            raise err

    def undefine(self) -> None:
        self.calls.append(("undefine", None))


@pytest.fixture
def host() -> LibvirtHost:
    return LibvirtHost("test:///default")


async def test_undefine_removes_the_nvram_first(host: LibvirtHost, monkeypatch: pytest.MonkeyPatch) -> None:
    dom = RecordingDomain()
    monkeypatch.setattr(host, "_lookup", lambda name: dom)
    assert await host.undefine("gpuaas-x") is True
    assert dom.calls == [("undefineFlags", libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)]


async def test_plain_undefine_only_when_the_driver_has_no_nvram_support(
    host: LibvirtHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    dom = RecordingDomain(refuse_nvram_with=libvirt.VIR_ERR_INVALID_ARG)
    monkeypatch.setattr(host, "_lookup", lambda name: dom)
    assert await host.undefine("gpuaas-x") is True
    assert dom.calls == [("undefineFlags", libvirt.VIR_DOMAIN_UNDEFINE_NVRAM), ("undefine", None)]
