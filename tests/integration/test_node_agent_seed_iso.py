"""The NoCloud seed ISO, read back with pycdlib the way a guest's cloud-init would find it."""

from __future__ import annotations

import io
from pathlib import Path

import pycdlib
import pytest
import yaml

from gpuaas_node_agent.adapters import seed_iso

USER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDsL0Zb1vUq2dXoX8QvVQ1kYd3n7o8h7x2cQb0k1k1k1 alice@laptop"
RELAY_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHqzN0k5dWm6p3nXv8m1pQ9rS2tU4vW6xY8zA0bC2dE4 gpuaas-terminal-relay"


def _read(iso_path: Path) -> tuple[str, dict[str, str], dict[str, str]]:
    iso = pycdlib.PyCdlib()
    iso.open(str(iso_path))
    try:
        label = iso.pvd.volume_identifier.decode().strip()
        rock: dict[str, str] = {}
        joliet: dict[str, str] = {}
        for child in iso.list_children(rr_path="/"):
            if child.is_dir():
                continue
            name = child.rock_ridge.name().decode()
            out = io.BytesIO()
            iso.get_file_from_iso_fp(out, rr_path=f"/{name}")
            rock[name] = out.getvalue().decode()
        for child in iso.list_children(joliet_path="/"):
            if child.is_dir():
                continue
            name = child.file_identifier().decode("utf-16-be")
            out = io.BytesIO()
            iso.get_file_from_iso_fp(out, joliet_path=f"/{name}")
            joliet[name] = out.getvalue().decode()
        return label, rock, joliet
    finally:
        iso.close()


async def test_seed_iso_has_cidata_label_and_files(tmp_path: Path) -> None:
    path = tmp_path / "seeds" / "vm1.iso"
    written = await seed_iso.write_seed_iso(
        path,
        instance_id="alloc-1234",
        hostname="slice-1234",
        ssh_authorized_keys=[USER_KEY],
        username="u_adda9308",
        relay_public_key=RELAY_KEY,
        network_config={
            "version": 2,
            "ethernets": {"eth0": {"match": {"macaddress": "52:54:00:00:00:01"}, "dhcp4": True}},
        },
    )
    assert written == path and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["vm1.iso"]  # no temp file left behind

    label, rock, joliet = _read(path)
    assert label == "cidata"
    assert set(rock) == {"user-data", "meta-data", "network-config"}
    assert joliet == rock

    assert rock["user-data"].startswith("#cloud-config\n")
    user_data = yaml.safe_load(rock["user-data"])
    assert user_data["hostname"] == "slice-1234"
    user, console = user_data["users"]
    assert user["name"] == "u_adda9308"
    # The relay key is the console user's alone (review 3, N8): never beside the tenant's sudo login.
    assert user["ssh_authorized_keys"] == [USER_KEY]
    assert user["lock_passwd"] is True
    assert console["name"] == seed_iso.CONSOLE_USER and console["ssh_authorized_keys"] == [RELAY_KEY]
    assert user_data["ssh_pwauth"] is False

    assert yaml.safe_load(rock["meta-data"]) == {"instance-id": "alloc-1234", "local-hostname": "slice-1234"}
    assert yaml.safe_load(rock["network-config"])["ethernets"]["eth0"]["dhcp4"] is True


async def test_default_user_and_no_network_config(tmp_path: Path) -> None:
    path = tmp_path / "vm2.iso"
    await seed_iso.write_seed_iso(path, instance_id="i-2", hostname="h2", ssh_authorized_keys=[USER_KEY, RELAY_KEY])
    _, rock, _ = _read(path)
    assert set(rock) == {"user-data", "meta-data"}
    user_data = yaml.safe_load(rock["user-data"])
    assert user_data["users"] == ["default"]
    assert user_data["ssh_authorized_keys"] == [USER_KEY, RELAY_KEY]


@pytest.mark.parametrize("username", ["u_adda9308", None])
async def test_the_relay_key_logs_in_as_a_console_user_with_no_sudo_and_no_root(
    tmp_path: Path, username: str | None
) -> None:
    """Review 3, N8: the seed authorised the relay key for the passwordless-sudo user (or the image's default
    user, sudo too), so whoever held it had root in every guest. Now only an unprivileged user of its own holds
    it: no sudo rule, no group, not root, and the key is nowhere else in the seed."""
    path = tmp_path / "vm-console.iso"
    await seed_iso.write_seed_iso(
        path,
        instance_id="i-c",
        hostname="hc",
        ssh_authorized_keys=[USER_KEY],
        username=username,
        relay_public_key=RELAY_KEY,
    )
    _, rock, _ = _read(path)
    doc = yaml.safe_load(rock["user-data"])
    holders = [u for u in doc["users"] if isinstance(u, dict) and RELAY_KEY in u.get("ssh_authorized_keys", [])]
    [console] = holders
    assert console["name"] == seed_iso.CONSOLE_USER != "root"
    assert console["sudo"] is False and "groups" not in console and console["lock_passwd"] is True
    # Top-level keys go to the default user and (refused) to root: the relay key is not among them.
    assert RELAY_KEY not in doc.get("ssh_authorized_keys", [])
    assert doc["disable_root"] is True
    assert rock["user-data"].count(RELAY_KEY.split()[1]) == 1
    with pytest.raises(seed_iso.SeedIsoError):
        seed_iso.render_user_data(
            hostname="hc", ssh_authorized_keys=[USER_KEY], relay_public_key=RELAY_KEY, console_user="root"
        )


async def test_rewrite_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "vm3.iso"
    await seed_iso.write_seed_iso(path, instance_id="first", hostname="h3", ssh_authorized_keys=[USER_KEY])
    await seed_iso.write_seed_iso(path, instance_id="second", hostname="h3", ssh_authorized_keys=[USER_KEY])
    _, rock, _ = _read(path)
    assert yaml.safe_load(rock["meta-data"])["instance-id"] == "second"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ssh_authorized_keys": []}, "at least one SSH public key"),
        ({"ssh_authorized_keys": [USER_KEY + "\nruncmd: [reboot]"]}, "single-line"),
        ({"ssh_authorized_keys": ["not a key"]}, "single-line"),
        ({"hostname": "bad_host!"}, "invalid hostname"),
        ({"username": "Root Admin"}, "invalid username"),
    ],
)
async def test_bad_input_is_refused_before_writing(tmp_path: Path, kwargs: dict, match: str) -> None:
    args = {"instance_id": "i-4", "hostname": "h4", "ssh_authorized_keys": [USER_KEY], **kwargs}
    path = tmp_path / "vm4.iso"
    with pytest.raises(seed_iso.SeedIsoError, match=match):
        await seed_iso.write_seed_iso(path, **args)
    assert not path.exists()
