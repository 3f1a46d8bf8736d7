"""dnsmasq DHCP reservations (one file per VM in a `dhcp-hostsdir`) and its lease file.

dnsmasq picks up new or changed files in the hostsdir by inotify without a restart or signal, and
ignores dot-files — so a reservation is written as a dot-file and renamed into place, and dnsmasq never
reads a half-written line. Removed entries linger inside dnsmasq until SIGHUP; the leases it already
handed out stay in the lease file until they expire.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tempfile
from pathlib import Path

from pydantic import BaseModel

from gpuaas_common.logging import get_logger

from .host import Host

log = get_logger(__name__)

_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class Reservation(BaseModel):
    mac: str
    ip: str
    hostname: str

    def line(self) -> str:
        return f"{self.mac},{self.ip},{self.hostname}"


class Lease(BaseModel):
    expiry: int  # epoch seconds; 0 = infinite
    mac: str
    ip: str
    hostname: str | None
    client_id: str | None


def _mac(text: str) -> str:
    mac = text.strip().lower().replace("-", ":")
    if not _MAC.match(mac):
        raise ValueError(f"invalid MAC address {text!r}")
    return mac


def _ipv4(text: str) -> str:
    try:
        return str(ipaddress.IPv4Address(text.strip()))
    except ValueError:
        raise ValueError(f"invalid IPv4 address {text!r}") from None


def _hostname(text: str) -> str:
    if not _HOSTNAME.match(text):
        raise ValueError(f"invalid hostname {text!r}: one DNS label of letters, digits and '-'")
    return text


def _reservation_path(hostsdir: str | os.PathLike[str], name: str) -> Path:
    if not _FILE_NAME.match(name):
        raise ValueError(f"invalid reservation name {name!r}")
    return Path(hostsdir) / name


def parse_reservation(text: str) -> Reservation:
    """Parse the `<mac>,<ip>,<hostname>` body of a reservation file (the part after `dhcp-host=`)."""
    fields = [f.strip() for f in text.strip().split(",")]
    if len(fields) != 3:
        raise ValueError(f"reservation {text.strip()!r}: expected <mac>,<ip>,<hostname>")
    return Reservation(mac=_mac(fields[0]), ip=_ipv4(fields[1]), hostname=_hostname(fields[2]))


def write_reservation(hostsdir: str | os.PathLike[str], name: str, mac: str, ip: str, hostname: str) -> Path:
    """Create or replace the reservation file `name` atomically; returns its path."""
    reservation = Reservation(mac=_mac(mac), ip=_ipv4(ip), hostname=_hostname(hostname))
    path = _reservation_path(hostsdir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(reservation.line() + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("dhcp_reservation_written", name=name, mac=reservation.mac, ip=reservation.ip, hostname=hostname)
    return path


def remove_reservation(hostsdir: str | os.PathLike[str], name: str) -> bool:
    """Remove the reservation file; False when there was none (release is idempotent)."""
    path = _reservation_path(hostsdir, name)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    log.info("dhcp_reservation_removed", name=name)
    return True


async def release_lease(host: Host, interface: str, ip: str, mac: str, lease_file: str | os.PathLike[str]) -> bool:
    """Make dnsmasq forget a released VM's lease (dnsmasq-utils' `dhcp_release` sends the DHCPRELEASE the guest
    never sent), so a released slot leaves no lease behind. Run where dnsmasq runs (the agent's network
    namespace). The lease's client id goes with it: dnsmasq matches a lease taken with one only by it (a guest's
    networkd sends one), and answers "unknown lease" otherwise. False when there is no lease, no `dhcp_release`,
    or it fails: a lease left then only expires."""
    lease = find_lease(lease_file, mac)
    if lease is None:
        return False
    if host.run.which("dhcp_release") is None:
        log.warning("dhcp_release_missing", interface=interface, ip=ip, mac=mac)
        return False
    argv = ["dhcp_release", interface, _ipv4(ip), _mac(mac)] + ([lease.client_id] if lease.client_id else [])
    res = await host.run.run(*argv)
    if not res.ok:
        log.warning("dhcp_release_failed", interface=interface, ip=ip, mac=mac, rc=res.rc, stderr=res.stderr[:300])
        return False
    log.info("dhcp_lease_released", interface=interface, ip=ip, mac=mac)
    return True


def read_reservations(hostsdir: str | os.PathLike[str]) -> dict[str, Reservation]:
    """Reservation files by name, as dnsmasq would see them (dot-files and editor backups skipped).
    Unparseable files are logged and left out."""
    out: dict[str, Reservation] = {}
    directory = Path(hostsdir)
    if not directory.is_dir():
        return out
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if name.startswith(".") or name.endswith("~") or (name.startswith("#") and name.endswith("#")):
            continue
        try:
            out[name] = parse_reservation(entry.read_text())
        except (OSError, ValueError) as exc:
            log.warning("dhcp_reservation_unreadable", name=name, error=str(exc))
    return out


def parse_lease_line(line: str) -> Lease | None:
    """One `<expiry> <mac> <ip> <hostname|*> <client-id|*>` line, or None for anything else (the DUID line,
    IPv6 leases, garbage from a concurrent rewrite)."""
    fields = line.split()
    if len(fields) != 5:
        return None
    expiry, mac, ip, hostname, client_id = fields
    try:
        expiry_n = int(expiry)
        mac = _mac(mac)
        ip = _ipv4(ip)
    except ValueError:
        return None
    if expiry_n < 0:
        return None
    return Lease(
        expiry=expiry_n,
        mac=mac,
        ip=ip,
        hostname=None if hostname == "*" else hostname,
        client_id=None if client_id == "*" else client_id,
    )


def parse_leases(text: str) -> list[Lease]:
    lines = text.split("\n")
    # dnsmasq terminates every line; an unterminated tail is a rewrite caught midway.
    if lines and lines[-1] != "":
        lines = lines[:-1]
    return [lease for lease in map(parse_lease_line, lines) if lease is not None]


def read_leases(path: str | os.PathLike[str]) -> list[Lease]:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    return parse_leases(data.decode("utf-8", errors="replace"))


def find_lease(path: str | os.PathLike[str], mac: str) -> Lease | None:
    """The lease of `mac` in the lease file, None when there is none. With several lines for one MAC the
    longest-lived wins (0 = infinite)."""
    wanted = _mac(mac)
    matches = [lease for lease in read_leases(path) if lease.mac == wanted]
    if not matches:
        return None
    return max(matches, key=lambda lease: float("inf") if lease.expiry == 0 else lease.expiry)
