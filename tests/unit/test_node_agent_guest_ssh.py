"""The agent's SSH facts: host-key fingerprints as OpenSSH prints them, the planted key in the seed, the domain
type probe, and a readiness wait that stops at once on a host key other than the planted one."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuaas_node_agent.adapters import guest_ssh, readiness, seed_iso
from gpuaas_node_agent.adapters.host import HostFs
from gpuaas_node_agent.adapters.hypervisor import choose_domain_type, probe_domain_type


async def test_fingerprint_is_what_ssh_keygen_prints(tmp_path: Path) -> None:
    key = guest_ssh.new_host_key()
    pub = tmp_path / "k.pub"
    pub.write_text(key.public_line + "\n")
    printed = (
        await asyncio.to_thread(subprocess.run, ["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True)
    ).stdout
    assert printed.split()[1] == key.fingerprint
    assert key.private_openssh.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")


def test_a_key_that_is_not_openssh_is_refused() -> None:
    with pytest.raises(guest_ssh.GuestSshError):
        guest_ssh.fingerprint("ssh-ed25519 not*base64")


async def test_the_seed_plants_the_host_key_and_no_other() -> None:
    key = guest_ssh.new_host_key()
    doc = yaml.safe_load(
        seed_iso.render_user_data(
            hostname="vm1",
            ssh_authorized_keys=[key.public_line],
            username="gpuaas",
            host_key=(key.private_openssh, key.public_line),
        ).removeprefix("#cloud-config\n")
    )
    assert doc["ssh_keys"] == {"ed25519_private": key.private_openssh, "ed25519_public": key.public_line}
    assert doc["ssh_genkeytypes"] == [] and doc["ssh_deletekeys"] is True
    with pytest.raises(seed_iso.SeedIsoError):
        seed_iso.render_user_data(
            hostname="vm1", ssh_authorized_keys=[key.public_line], host_key=("not a key", key.public_line)
        )


async def test_the_agent_login_key_is_made_once_and_private(tmp_path: Path) -> None:
    path, public = await guest_ssh.agent_login_key(tmp_path / "state")
    again, public_again = await guest_ssh.agent_login_key(tmp_path / "state")
    assert (path, public) == (again, public_again)
    assert path.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    ("kvm", "flags", "want"),
    [
        (True, "fpu vmx sse", "kvm"),
        (True, "fpu svm sse", "kvm"),
        (True, "fpu sse hypervisor", "qemu"),  # a VM whose hypervisor hides VMX/SVM: /dev/kvm alone lies
        (False, "fpu vmx", "qemu"),
    ],
)
def test_the_domain_type_probe(tmp_path: Path, kvm: bool, flags: str, want: str) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    if kvm:
        (tmp_path / "dev").mkdir()
        (tmp_path / "dev/kvm").touch()
    chosen, why = probe_domain_type(HostFs(tmp_path))
    assert chosen == want and why
    assert choose_domain_type("kvm", HostFs(tmp_path))[0] == "kvm"  # a setting other than auto wins


async def test_readiness_stops_at_once_on_a_host_key_that_is_not_the_planted_one(tmp_path: Path) -> None:
    async def sshd(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2p1\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(sshd, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    leases = tmp_path / "leases"
    leases.write_text("0 52:54:00:00:00:01 127.0.0.1 vm1 *\n")
    calls: list[str] = []

    async def login(ip: str) -> guest_ssh.LoginOutcome:
        calls.append(ip)
        return guest_ssh.LoginOutcome(False, host_key_mismatch=True, detail="not the planted key")

    try:
        ready = await readiness.wait_ready(str(leases), "52:54:00:00:00:01", "127.0.0.1", port, 30.0, login=login)
    finally:
        server.close()
        await server.wait_closed()
    assert ready.host_key_mismatch and not ready.ssh_ready and calls == ["127.0.0.1"]
    assert set(ready.phase_seconds) == {"lease", "ssh"}
