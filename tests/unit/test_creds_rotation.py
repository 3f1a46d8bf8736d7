"""The issuer's half of renewal, without a server: lifetimes, when a file is due, which files are renewed, and the
host users' bookkeeping that keeps revocations small however often a host is renewed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gpuaas_common.identity import Authority
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.authority import (
    ADMIN_USER_TTL_S,
    DEFAULT_USER_TTL_S,
    HOST_USER_TTL_S,
    _host_entry,
    _live,
)
from gpuaas_common.identity.permissions import ADMIN, ROLE_PERMISSIONS, SERVICES
from gpuaas_common.identity.rotation import host_files, renew_role_files, renewal_due


def _lifetime(creds: creds_files.Creds) -> float:
    return float(creds.claims["exp"] - creds.claims["iat"])


def test_lifetimes_are_hours_to_days() -> None:
    auth = Authority.create()
    for role in (*SERVICES, "portal", "ops"):
        assert _lifetime(auth.issue_user(role, ROLE_PERMISSIONS[role])) == DEFAULT_USER_TTL_S == 24 * 3600
    assert _lifetime(auth.issue_user(ADMIN, ROLE_PERMISSIONS[ADMIN])) == ADMIN_USER_TTL_S == 12 * 3600
    assert _lifetime(auth.issue_host("n1")) == HOST_USER_TTL_S == 72 * 3600


def test_a_file_is_due_once_less_than_half_its_lifetime_is_left() -> None:
    creds = Authority.create().issue_user("ops", ROLE_PERMISSIONS["ops"], ttl_s=1000)
    iat = creds.claims["iat"]
    assert not renewal_due(creds, now=iat)
    assert not renewal_due(creds, now=iat + 499)
    assert renewal_due(creds, now=iat + 501)
    assert renewal_due(creds, now=iat + 2000), "an expired file is due too"


def test_role_files_are_renewed_when_due_and_admin_only_when_asked(tmp_path: Path) -> None:
    auth = Authority.create()
    fresh = auth.issue_user("allocator", ROLE_PERMISSIONS["allocator"])
    creds_files.write(tmp_path / "allocator.creds", fresh)
    creds_files.write(tmp_path / "portal.creds", auth.issue_user("portal", ROLE_PERMISSIONS["portal"], ttl_s=10))
    creds_files.write(tmp_path / "admin.creds", auth.issue_user(ADMIN, ROLE_PERMISSIONS[ADMIN], ttl_s=10))
    (tmp_path / "ops.creds").write_text("damaged")
    later = time.time() + 6  # the 10-second files are past half-life
    assert renew_role_files(auth, tmp_path, now=later) == ["portal", "ops"]
    assert creds_files.read(tmp_path / "allocator.creds").jwt == fresh.jwt, "not due: left alone"
    assert _lifetime(creds_files.read(tmp_path / "portal.creds")) == DEFAULT_USER_TTL_S
    assert not (tmp_path / "scheduler.creds").exists(), "a role without a file here is not issued here"
    assert renew_role_files(auth, tmp_path, include_admin=True, now=later) == [ADMIN]
    assert _lifetime(creds_files.read(tmp_path / "admin.creds")) == ADMIN_USER_TTL_S
    assert (tmp_path / "portal.creds").stat().st_mode & 0o777 == 0o600


def test_host_files_are_found_by_their_node_tag_and_baremetal_users_are_not_ours(tmp_path: Path) -> None:
    auth = Authority.create()
    creds_files.write(tmp_path / "node-a:1.creds", auth.issue_host("a:1"))
    creds_files.write(tmp_path / "bm.creds", auth.issuer().issue_node("bm-1", ttl_s=60, allocation_id="x1"))
    creds_files.write(tmp_path / "ops.creds", auth.issue_user("ops", ROLE_PERMISSIONS["ops"]))
    (tmp_path / "junk.creds").write_text("no")
    assert host_files(tmp_path) == {"a:1": tmp_path / "node-a:1.creds"}


def test_a_renewed_host_forgets_its_expired_users_and_the_keys_remember_expiries(tmp_path: Path) -> None:
    auth = Authority.create()
    old = auth.issue_host("n1", ttl_s=1)
    legacy = "ULEGACYUSERWITHOUTKNOWNEXPIRY"
    auth.issued_hosts["n1"].insert(0, legacy)  # issued before expiries were kept: never forgotten
    auth.host_expiry[old.claims["sub"]] = int(time.time()) - 1  # as if its second had passed
    new = auth.issue_host("n1")
    assert auth.issued_hosts["n1"] == [legacy, new.claims["sub"]]
    assert old.claims["sub"] not in auth.host_expiry
    auth.save(tmp_path)
    again = Authority.load(tmp_path)
    assert again.issued_hosts == auth.issued_hosts and again.host_expiry == auth.host_expiry
    (tmp_path / "issued-hosts-expiry.json").unlink()  # keys saved before it existed
    assert Authority.load(tmp_path).host_expiry == {}


@pytest.mark.parametrize(
    ("stored", "live"),
    [
        (["U1", "U2"], ["U1", "U2"]),  # written as a list before expiries were kept: all kept
        ({"U1": 1, "U2": None, "U3": 4_000_000_000}, ["U2", "U3"]),
    ],
)
def test_the_host_users_entry_reads_both_shapes_and_drops_the_expired(stored: object, live: list[str]) -> None:
    entry = _host_entry(json.dumps(stored).encode())
    assert sorted(_live(entry, time.time())) == live
    # A reader from before takes the entry as a list of keys: a dict still lists them.
    assert list(json.loads(json.dumps(entry))) == list(entry)


# Not a skip left to rot: chown to another user needs root, which the renewer is in compose and CI is (the lab
# tests need it too); a developer's unprivileged run skips this one test and says why.
@pytest.mark.skipif(os.geteuid() != 0, reason="only root gives a file away")
def test_a_renewed_file_keeps_the_owner_of_the_one_it_replaces(tmp_path: Path) -> None:
    """Compose gives each creds file to its one reader; the renewer, root, must not take it back."""
    auth = Authority.create()
    path = tmp_path / "allocator.creds"
    creds_files.write(path, auth.issue_user("allocator", ROLE_PERMISSIONS["allocator"], ttl_s=10))
    os.chown(path, 12345, 23456)
    assert renew_role_files(auth, tmp_path, now=time.time() + 6) == ["allocator"]
    st = path.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (12345, 23456, 0o600)
