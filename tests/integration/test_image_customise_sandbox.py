"""The image's own programs (apt, its maintainer scripts) run in a sandbox that cannot reach the build host
(issue 38, N5c): on the lab's real Debian base, a script that looks for the host's disks the way a hostile
postinst would (block devices in /dev, /sys/block, a device node made by hand, a mount, the network) finds
none of them, and what it tries leaves the host as it was.

Needs root and loop devices, as the image pipeline's build hosts do; fails rather than skips without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuaas_dev.lab.base_image import ensure_base_image
from gpuaas_image_pipeline.adapters import customise_chroot, qemu

LOOK_FOR_DISKS = r"""
found=""
for d in /dev/* /dev/*/*; do [ -b "$d" ] && found="$found $d"; done
sys=$(ls /sys/block 2>/dev/null | tr '\n' ' ')
mknod /tmp/hostdisk b 8 0 2>/dev/null && made=yes || made=no
mkdir -p /tmp/m && mount -t proc proc /tmp/m 2>/dev/null && mounted=yes || mounted=no
nets=$(ls /sys/class/net 2>/dev/null; ip -o link 2>/dev/null | awk -F': ' '{print $2}' | tr '\n' ' ')
touch /gpuaas-sandbox-was-here
printf '{"block": "%s", "sys_block": "%s", "mknod": "%s", "mount": "%s", "links": "%s", "uid": "%s"}\n' \
  "$found" "$sys" "$made" "$mounted" "$nets" "$(id -u)"
"""


def _names(d: str) -> list[str]:
    return sorted(p.name for p in Path(d).iterdir())


def _block_devices() -> list[str]:
    return sorted(str(p) for p in Path("/dev").iterdir() if p.is_block_device())


@pytest.mark.timeout(600)
async def test_a_maintainer_script_looking_for_the_hosts_disks_sees_none(tmp_path: Path) -> None:
    base = await ensure_base_image()
    raw = tmp_path / "base.raw"
    await qemu.convert_to_raw(base.path, "qcow2", raw)
    assert _block_devices(), "the build host has block devices to hide (loop devices at least)"
    host_root_before = _names("/")

    part = customise_chroot.find_root(raw)
    mnt = tmp_path / "root"
    async with customise_chroot.loop_device(raw, part) as dev, customise_chroot.mounted(dev, mnt, "-t", "ext4"):
        rc, out, err = await customise_chroot._in_chroot(mnt, "/bin/sh", "-c", LOOK_FOR_DISKS)
        assert rc == 0, err
        wrote = (mnt / "gpuaas-sandbox-was-here").exists()

    seen = json.loads(out)
    assert seen["block"].strip() == "" and seen["sys_block"].strip() == ""
    assert (seen["mknod"], seen["mount"]) == ("no", "no")
    assert seen["links"].split() in ([], ["lo"]), seen["links"]
    assert seen["uid"] == "0"  # root of the image (its files stay root's), but without the host's powers
    # The script's / was the image's root: its file landed there, not in the host's /.
    assert wrote and _names("/") == host_root_before
