"""Persistent vfio-pci binding through driverctl (one override file per device under /etc/driverctl.d, the
device rebound at once) and the bound driver read back from sysfs."""

from __future__ import annotations

from ..domain.device_binding import VFIO_DRIVER, parse_list_overrides
from .host import Host


class DriverctlError(Exception):
    pass


async def list_overrides(host: Host) -> dict[str, str]:
    res = await host.run.run("driverctl", "list-overrides")
    if not res.ok:
        raise DriverctlError(f"driverctl list-overrides exited with {res.rc}: {res.stderr[:200]}")
    return parse_list_overrides(res.stdout)


async def set_vfio_override(host: Host, bdf: str) -> None:
    res = await host.run.run("driverctl", "set-override", bdf, VFIO_DRIVER)
    if not res.ok:
        raise DriverctlError(f"driverctl set-override {bdf} exited with {res.rc}: {res.stderr[:200]}")


async def unset_override(host: Host, bdf: str) -> None:
    res = await host.run.run("driverctl", "unset-override", bdf)
    if not res.ok:
        raise DriverctlError(f"driverctl unset-override {bdf} exited with {res.rc}: {res.stderr[:200]}")


def bound_driver(host: Host, bdf: str) -> str | None:
    """The driver the device is bound to now (its sysfs `driver` symlink), None when unbound or absent."""
    return host.fs.link_name(f"/sys/bus/pci/devices/{bdf}/driver")
