"""A baremetal allocation on the lab: the MAAS simulator's machine is a real VM behind its `virsh` power driver.

The dev stack runs with the lab and its baremetal machine (and no simulated baremetal host, so the scheduler can
only place on it). At start the image pipeline archived the lab's curated host image (Debian 12 from packages,
the node agent installed from this checkout's wheel with its systemd unit enabled) and the MAAS gateway uploaded
it as `custom/<slug>`, which the site profile deploys with `storage_layout=flat`. The test is a portal: it asks
for a baremetal host and follows the lifecycle, every message checked against the contract.

What happens in between is the product's and MAAS's, not the test's: the gateway allocates and deploys with
user-data; the simulator installs the uploaded tgz on the machine's disk as curtin would, hands the user-data over
as a NoCloud seed of exactly the bytes the gateway sent, and powers the VM on; cloud-init writes the agent's files;
the production agent (started by systemd in the guest) enrols over the lab's forwarded NATS with its
allocation-bound credentials, and the allocation goes `active` with where and as whom to log in: the tenant's key
reached the image's default user through the same user-data, and the test logs in with it from the lab's
namespace. The walk's phases (allocate, deploy, first boot, enrolment, active) are on the timeline. The release
revokes the host's credentials (a publish with them is refused), releases the machine with erase, and the VM is
off with its disk wiped.

One guest boots (three to six minutes under TCG on two cores). It runs wherever the lab's pieces are installed
and the process is root, and there it fails, never skips, when the lab does not work.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pycdlib
import pytest
import yaml
from nats.aio.client import RawCredentials

from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.tls import client_tls_options
from gpuaas_dev.lab.host_image import SLUG
from gpuaas_dev.maas_sim.virsh_power import QUICK_ERASE_BYTES
from gpuaas_dev.stack import Stack
from gpuaas_dev.stack.lab_machine import LAB_MACHINE, LAB_MACHINE_IP
from gpuaas_dev.testing.waiting import eventually

from .conftest import maas_sim
from .lab_checks import lab_only, run

pytestmark = lab_only  # why this is no skip left to rot: lab_checks.lab_only

BOOT_S = 900.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tmp_path_factory.mktemp("labbm"),
        slice_hosts=0,
        baremetal_hosts=0,
        lab=True,
        lab_baremetal=True,
        unsafe_no_fsync=True,
    )
    s.start()
    yield s
    netns = s.lab_host.state.netns
    s.stop()
    assert not Path(f"/run/netns/{netns}").exists()


def _virsh(stack: Stack, *args: str) -> str:
    uri = stack.lab_host.state.libvirt_uri
    return subprocess.run(["virsh", "-c", uri, *args], capture_output=True, text=True).stdout.strip()


def _seed_user_data(iso_path: Path) -> bytes:
    iso = pycdlib.PyCdlib()
    iso.open(str(iso_path))
    try:
        out = io.BytesIO()
        iso.get_file_from_iso_fp(out, rr_path="/user-data")
        return out.getvalue()
    finally:
        iso.close()


async def _connect_as_host(stack: Stack, creds_text: str) -> None:
    """Connects with the host's credentials (from the user-data the machine got) and closes again: the server
    refuses a revoked user at connect, before anything could be published."""
    name = creds_files.parse(creds_text).name
    nc = await nats.connect(
        stack.nats_url,
        user_credentials=RawCredentials(creds_text),
        **client_tls_options(stack.ca_file),
        inbox_prefix=f"_INBOX_{name}".encode(),
        allow_reconnect=False,
        connect_timeout=5,
    )
    await nc.close()


# Who the tenant is, the agent's unit, the kernel command line GRUB gave, the ESP's filesystem: one line each.
LOGIN_PROBE = "id -un; systemctl is-active gpuaas-node-agent; cat /proc/cmdline; findmnt -no FSTYPE /boot/efi"


async def _tenant_login(
    stack: Stack, key: Path, access: dict, command: str = LOGIN_PROBE
) -> subprocess.CompletedProcess[str]:
    """The tenant's login from the lab's namespace, with the key it asked for. MAAS names no host key for a
    deployed machine, so none is pinned here (the slice path pins the one its seed planted)."""
    argv = stack.lab_host.ns(
        "ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10", "-i", str(key), "-p", str(access["port"]),
        f"{access['user']}@{access['ip']}", command,
    )  # fmt: skip
    return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)


# The stack's start builds the host image when its recipe or the agent changed (about 2 minutes) and uploads it.
@pytest.mark.timeout(1800)
async def test_baremetal_allocation_boots_the_host_image_on_a_vm_and_the_agent_enrols(
    portal, stack, db, tmp_path
) -> None:
    tenant = tmp_path / "tenant"
    assert run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tenant)]).returncode == 0
    key = (tmp_path / "tenant.pub").read_text().strip()
    t0 = time.monotonic()
    alloc = await portal.request("baremetal", gpus=8, ssh_public_keys=[key])
    placed = await portal.wait_state(alloc, "placed", timeout=60)
    assert placed["payload"]["node_id"] == LAB_MACHINE
    system_id = placed["payload"]["maas_system_id"]
    active = await portal.wait_state(alloc, "active", timeout=BOOT_S)
    active_s = time.monotonic() - t0
    access = active["payload"]["access"]
    assert (access["maas_system_id"], access["ip"], access["user"], access["port"]) == (
        system_id,
        LAB_MACHINE_IP,
        "debian",
        22,
    )

    # The tenant logs in with its own key (sshd may still be starting when the agent enrols: asked until it answers;
    # ssh's own failures exit 255, anything else is the probe's answer).
    async def logged_in() -> subprocess.CompletedProcess[str] | None:
        done = await _tenant_login(stack, tenant, access)
        return done if done.returncode != 255 else None

    login = await eventually(logged_in, timeout=300, interval=3, what="the tenant's SSH login to the machine")
    if login.returncode != 0:
        journal = await _tenant_login(
            stack, tenant, access, "sudo journalctl -b -u gpuaas-node-agent -u boot-efi.mount -n 60 --no-pager"
        )
        pytest.fail(f"the probe exited {login.returncode}: {login.stdout!r} {login.stderr!r}\n{journal.stdout}")
    user, agent, cmdline, esp = login.stdout.splitlines()
    assert (user, agent, esp) == ("debian", "active", "vfat")  # the ESP the install made, mounted as MAAS's are
    # Booted by the GRUB installed on its own disk (GRUB names the kernel it loaded), with the image's arguments.
    assert "BOOT_IMAGE=/boot/vmlinuz" in cmdline.split() and "intel_iommu=on" in cmdline.split()

    machine = await maas_sim(stack, "GET", f"/_sim/machines/{system_id}")
    assert (machine["power_type"], machine["status_name"], machine["ip_addresses"]) == (
        "virsh",
        "Deployed",
        [LAB_MACHINE_IP],
    )
    deploy = machine["_sim"]["last_deploy"]
    assert (deploy["osystem"], deploy["distro_series"], deploy["storage_layout"]) == ("custom", SLUG, "flat")
    # The machine got exactly what the gateway sent, through the seed.
    sent = base64.b64decode(deploy["user_data_b64"])
    work = Path(stack.lab_host.state.host_dir) / "maas" / LAB_MACHINE
    assert _seed_user_data(work / "seed.iso") == sent
    assert _virsh(stack, "domstate", f"maas-{LAB_MACHINE}") == "running"
    # The enrolment came from the agent in the VM (the simulated fleet runs no host for this node).
    enrolled = portal.spy.of_type("node.enrolled", allocation_id=alloc) or [
        e for e in portal.spy.of_type("node.enrolled") if e["payload"].get("node_id") == LAB_MACHINE
    ]
    assert enrolled and enrolled[0]["payload"]["kind"] == "baremetal"
    assert enrolled[0]["payload"]["maas_system_id"] == system_id

    user_data = yaml.safe_load(sent)
    assert user_data["ssh_authorized_keys"] == [key]
    creds_text = next(f["content"] for f in user_data["write_files"] if f["path"] == "/etc/gpuaas/node.creds")
    await _connect_as_host(stack, creds_text)  # valid while the allocation is active

    t1 = time.monotonic()
    await portal.release(alloc)
    await portal.wait_state(alloc, "released", timeout=300)
    released_s = time.monotonic() - t1
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await _connect_as_host(stack, creds_text)
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{system_id}")
    assert machine["status_name"] == "Ready"
    assert [h["to"] for h in machine["_sim"]["history"]][-2:] == ["Disk erasing", "Ready"]
    assert _virsh(stack, "domstate", f"maas-{LAB_MACHINE}") == "shut off"
    disk = work / "disk.img"
    # The site's default wipe policy (blkdiscard): MAAS's secure erase (the lab machine's disk has one), never the
    # quick erase of 2 MiB at each end; every flag was sent, so the region's own defaults chose nothing.
    asked = machine["_sim"]["last_release"]
    assert (asked["erase_mode"], asked["secure_erase"], asked["quick_erase"]) == ("secure", True, False)
    with disk.open("rb") as f:
        head = f.read(4 * QUICK_ERASE_BYTES)
        assert head.count(0) == len(head)
    probe = await asyncio.to_thread(subprocess.run, ["blkid", "-p", str(disk)], capture_output=True)
    assert probe.returncode == 2  # no signature left anywhere blkid looks

    rows = await db.fetch(
        "SELECT state, reason_code, detail, at FROM allocator.allocation_timeline WHERE allocation_id = $1 "
        "ORDER BY seq",
        alloc,
    )
    phases = {
        d["phase"]: d["seconds"]
        for d in (json.loads(r["detail"]) if isinstance(r["detail"], str) else r["detail"] for r in rows)
        if d and "phase" in d
    }
    assert list(phases) == ["allocate", "deploy", "first_boot", "enrolment", "active"]
    assert 0 < phases["first_boot"] < phases["active"] <= active_s + 1  # the guest's own clock, inside the walk
    start = rows[0]["at"]
    print(f"\nbaremetal walk on the lab: active after {active_s:.1f} s, released after {released_s:.1f} s")
    for row in rows:
        detail = row["detail"] if isinstance(row["detail"], dict) else json.loads(row["detail"] or "{}")
        phase = f"{detail['phase']} {detail['seconds']:.1f} s" if detail and "phase" in detail else ""
        print(f"  +{(row['at'] - start).total_seconds():7.1f}s  {row['state']:<14} {row['reason_code'] or ''} {phase}")
    print(f"  revoked: the host's credentials are refused after the release; tenant login: {login.stdout.splitlines()}")
