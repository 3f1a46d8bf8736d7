"""dnsmasq reservation files and a lease-file reader that survives dnsmasq rewriting the file in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuaas_node_agent.adapters import dnsmasq


def test_reservation_written_atomically_and_removed(tmp_path: Path) -> None:
    hostsdir = tmp_path / "hosts.d"
    path = dnsmasq.write_reservation(hostsdir, "gpuaas-slice-1", "52:54:00:AB:CD:EF", "10.100.0.10", "slice-1")
    assert path == hostsdir / "gpuaas-slice-1"
    assert path.read_text() == "52:54:00:ab:cd:ef,10.100.0.10,slice-1\n"
    assert [p.name for p in hostsdir.iterdir()] == ["gpuaas-slice-1"]
    dnsmasq.write_reservation(hostsdir, "gpuaas-slice-1", "52:54:00:ab:cd:ef", "10.100.0.11", "slice-1")
    assert dnsmasq.read_reservations(hostsdir)["gpuaas-slice-1"].ip == "10.100.0.11"
    assert dnsmasq.remove_reservation(hostsdir, "gpuaas-slice-1") is True
    assert dnsmasq.remove_reservation(hostsdir, "gpuaas-slice-1") is False
    assert dnsmasq.read_reservations(hostsdir) == {}


@pytest.mark.parametrize(
    ("name", "mac", "ip", "hostname", "match"),
    [
        ("../x", "52:54:00:00:00:01", "10.0.0.1", "h", "reservation name"),
        ("n", "52:54:00:00:01", "10.0.0.1", "h", "MAC"),
        ("n", "52:54:00:00:00:01", "10.0.0.256", "h", "IPv4"),
        ("n", "52:54:00:00:00:01", "10.0.0.1", "h,ignore", "hostname"),
        ("n", "52:54:00:00:00:01", "10.0.0.1", "h\ndhcp-range=x", "hostname"),
    ],
)
def test_bad_reservations_are_refused(tmp_path: Path, name: str, mac: str, ip: str, hostname: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dnsmasq.write_reservation(tmp_path, name, mac, ip, hostname)
    assert list(tmp_path.iterdir()) == []


def test_read_reservations_skips_dotfiles_backups_and_garbage(tmp_path: Path) -> None:
    (tmp_path / "good").write_text("52:54:00:00:00:01,10.0.0.1,h1\n")
    (tmp_path / ".good.tmp").write_text("52:54:00:00:00:02,10.0.0.2,h2\n")
    (tmp_path / "good~").write_text("52:54:00:00:00:03,10.0.0.3,h3\n")
    (tmp_path / "broken").write_text("52:54:00\n")
    assert set(dnsmasq.read_reservations(tmp_path)) == {"good"}


def test_lease_parser_tolerates_partial_and_garbled_lines() -> None:
    text = (
        "1700000000 52:54:00:aa:bb:01 10.100.0.10 slice-1 01:52:54:00:aa:bb:01\n"
        "0 52:54:00:AA:BB:02 10.100.0.11 * *\n"
        "duid 00:01:00:01:2c:aa:bb:cc:dd:ee:ff:00\n"
        "1700000000 1234 fd00::10 host 00:01:00:01\n"  # IPv6 lease: IAID, not a MAC
        "garbage\n"
        "17000x0000 52:54:00:aa:bb:03 10.100.0.12 h *\n"
        "1700000000 52:54:00:aa:bb:04 10.100.0 h *\n"
        "\n"
        "1700000000 52:54:00:aa:bb:05 10.100.0.14 slice-5 01:52:5"  # rewrite caught midway, no newline yet
    )
    leases = dnsmasq.parse_leases(text)
    assert [(lease.mac, lease.ip, lease.hostname, lease.client_id) for lease in leases] == [
        ("52:54:00:aa:bb:01", "10.100.0.10", "slice-1", "01:52:54:00:aa:bb:01"),
        ("52:54:00:aa:bb:02", "10.100.0.11", None, None),
    ]
    assert dnsmasq.parse_leases("") == []


def test_find_lease_compares_mac_lowercase_and_prefers_longest_lived(tmp_path: Path) -> None:
    path = tmp_path / "dnsmasq.leases"
    assert dnsmasq.find_lease(path, "52:54:00:aa:bb:01") is None  # no file yet
    path.write_text(
        "1700000000 52:54:00:aa:bb:01 10.100.0.10 old *\n"
        "1800000000 52:54:00:aa:bb:01 10.100.0.20 new *\n"
        "1700000000 52:54:00:aa:bb:02 10.100.0.11 other *\n"
    )
    lease = dnsmasq.find_lease(path, "52:54:00:AA:BB:01")
    assert lease is not None and (lease.ip, lease.hostname, lease.expiry) == ("10.100.0.20", "new", 1800000000)
    assert dnsmasq.find_lease(path, "52:54:00:aa:bb:09") is None
    path.write_bytes(b"\xff\xfe garbage\n0 52:54:00:aa:bb:01 10.100.0.30 h *\n")
    assert dnsmasq.find_lease(path, "52:54:00:aa:bb:01").ip == "10.100.0.30"
