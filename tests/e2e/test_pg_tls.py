"""`gpuaas dev up --pg-tls`: the stack's Postgres speaks TLS only, and every service's connection uses it."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator

import asyncpg
import pytest

from gpuaas_common.pg_roles import SERVICE_ROLES
from gpuaas_dev.stack import SERVICES, Stack


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"), slice_hosts=1, baremetal_hosts=0, unsafe_no_fsync=True, pg_tls=True)
    s.start()
    yield s
    s.stop()


async def test_every_service_connects_over_verified_tls_and_plaintext_is_refused(tls_stack: Stack) -> None:
    for service in SERVICE_ROLES:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(tls_stack.service_dsn(service)).query)
        assert query["sslmode"] == ["verify-full"] and query["sslrootcert"], service
    admin = await asyncpg.connect(tls_stack.admin_dsn)
    try:
        # The services are ready: each holds its pool and its relay's connections, all on TLS.
        rows = await admin.fetch(
            "SELECT a.usename, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
            "WHERE a.usename = ANY($1::text[])",
            [spec.role for spec in SERVICE_ROLES.values()],
        )
    finally:
        await admin.close()
    running = {SERVICE_ROLES[s].role for s in SERVICES if s in SERVICE_ROLES}
    assert running and running <= {r["usename"] for r in rows}
    assert all(r["ssl"] for r in rows), [r["usename"] for r in rows if not r["ssl"]]
    plain = tls_stack.admin_dsn.split("?", 1)[0] + "?sslmode=disable"
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError, match="no encryption"):
        await asyncpg.connect(plain)
