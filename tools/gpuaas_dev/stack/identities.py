"""The stack's bus identities: the NATS trust chain (operator, accounts, CA), one creds file per role and
per slice host, the streams and durables provisioned as the admin identity, and each process's NATS env."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuaas_common.fleet import Fleet
from gpuaas_common.identity import Authority
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS, node_user_name
from gpuaas_common.identity.permissions import SERVICES as BUS_SERVICES
from gpuaas_common.identity.tls import TlsFiles, issue_server_cert, make_ca_and_server_cert

from .coroutines import run_coro
from .processes import AUTHORITY

AUTHORITY_CERT = AUTHORITY


def make_identities(run_dir: Path, creds_dir: Path, extra_ips: tuple[str, ...] = ()) -> tuple[TlsFiles, Authority]:
    """A fresh operator, accounts and CA for every start; one creds file per identity (0600). `extra_ips`: other
    addresses clients reach the servers at (the lab's bridge), named in the server certificate."""
    tls = make_ca_and_server_cert(run_dir / "tls", ips=("127.0.0.1", *extra_ips))
    auth = Authority.create()
    for role, perms in ROLE_PERMISSIONS.items():
        creds_files.write(creds_dir / f"{role}.creds", auth.issue_user(role, perms))
    keys = run_dir / "keys"
    auth.save(keys)
    # The credential authority's HTTPS listener, from the same CA: the gateway pins the one CA it has.
    issue_server_cert(run_dir / "tls", AUTHORITY_CERT, hostnames=("localhost",), ips=("127.0.0.1",))
    return tls, auth


def onboard_slice_hosts(authority: Authority, fleet: Fleet, creds_dir: Path, keys_dir: Path) -> None:
    """What ops do when a slice host joins: its own user and creds file, its task durable."""
    for node in fleet.nodes:
        if node.kind == "slice_host":
            creds_files.write(creds_dir / f"{node_user_name(node.node_id)}.creds", authority.issue_host(node.node_id))
    authority.save(keys_dir)


def provision_bus(
    options: dict[str, Any],
    node_ids: list[str],
    replicas: int = 1,
    host_users: dict[str, list[str]] | None = None,
    expiry: dict[str, int] | None = None,
) -> None:
    """Streams and every slice host's durable, as the admin identity (`options`): no service or host may; and
    the slice hosts' users (`host_users`, node id → public keys; `expiry`: their expiries), so the gateway can
    end them."""

    async def provision_all() -> None:
        import nats

        from gpuaas_common.identity.authority import record_host_users
        from gpuaas_common.jetstream import node_agent_consumer, provision

        nc = await nats.connect(**options, connect_timeout=5, max_reconnect_attempts=3)
        try:
            js = nc.jetstream()
            await provision(js, [node_agent_consumer(n) for n in node_ids], replicas=replicas)
            for node_id, users in (host_users or {}).items():
                await record_host_users(js, node_id, users, expiry=expiry)
        finally:
            await nc.close()

    run_coro(provision_all)


def renew_credentials(
    authority: Authority, creds_dir: Path, options: dict[str, Any], tls: TlsFiles, now: float | None = None
) -> list[str]:
    """What a deployment's `gpuaas identities renew` does, for the stack's run dir: every role's file past
    half-life (admin's too: the stack's break-glass file, which tests and the CLI use) and every slice host's
    (its new user recorded on the bus as admin, `options`). The processes reading them switch without a gap.
    Returns what was renewed; the caller saves `authority`. `now`: the clock to judge by (a test's later one)."""
    from gpuaas_common.identity.rotation import host_files, renew_host_files, renew_role_files
    from gpuaas_common.identity.tls import client_context

    renewed = renew_role_files(authority, creds_dir, include_admin=True, now=now)

    async def hosts() -> dict[str, str]:
        import nats

        nc = await nats.connect(**options, connect_timeout=5, max_reconnect_attempts=3)
        try:
            servers = list(options["servers"])
            return await renew_host_files(
                authority,
                host_files(creds_dir),
                js=nc.jetstream(),
                nats_servers=servers,
                tls=client_context(tls.ca),
                now=now,
            )
        finally:
            await nc.close()

    return renewed + [node for node, outcome in run_coro(hosts).items() if outcome == "renewed"]


def nats_env(name: str, tls: TlsFiles, creds_dir: Path, keys_dir: Path, authority_port: int) -> dict[str, str]:
    """The CA and creds process `name` connects with; the keys for the credential authority alone, and its
    address for the gateway (which signs its requests with its own creds and pins the same CA)."""
    env = {"GPUAAS_NATS_CA_FILE": str(tls.ca)}
    if name in BUS_SERVICES or name == AUTHORITY:
        env["GPUAAS_NATS_CREDS"] = str(creds_dir / f"{name}.creds")
    if name == "node-agent":
        env["GPUAAS_NATS_CREDS_DIR"] = str(creds_dir)
    if name == "maas-gateway":
        env["GPUAAS_CREDENTIAL_AUTHORITY_URL"] = f"https://127.0.0.1:{authority_port}"
    if name == AUTHORITY:
        cert_dir = tls.ca.parent
        env.update(
            GPUAAS_KEYS_DIR=str(keys_dir),
            GPUAAS_API_PORT=str(authority_port),
            GPUAAS_API_TLS_CERT_FILE=str(cert_dir / f"{AUTHORITY_CERT}.pem"),
            GPUAAS_API_TLS_KEY_FILE=str(cert_dir / f"{AUTHORITY_CERT}-key.pem"),
        )
    return env
