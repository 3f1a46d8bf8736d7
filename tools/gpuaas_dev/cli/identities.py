"""`gpuaas identities …`: the bus's trust chain for a deployment, and host onboarding/decommissioning.

`init` writes a directory (keys 0600, one `.creds` per role, a CA and server certificate, and the
operator-mode block of the NATS config) — docker-compose's init step and any deployment without its
own PKI use it. `onboard-host` is what ops run when a slice host joins: its own user in a 0600 creds
file and its task durable. `decommission-host` revokes every user ever issued to the host, at once,
without restarting a server.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from gpuaas_common.identity import Authority
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS, node_user_name, render_table
from gpuaas_common.identity.tls import make_ca_and_server_cert

err = Console(stderr=True, highlight=False)
identities_app = typer.Typer(no_args_is_help=True, help="Bus identities: keys, creds, host onboarding.")

KeysOpt = Annotated[Path, typer.Option("--keys-dir", help="Directory of the deployment's keys (0700).")]


@identities_app.command("table")
def table() -> None:
    """Print who may publish and subscribe what (the README's table, rendered from the code)."""
    print(render_table(), end="")


@identities_app.command("init")
def init(
    out: Annotated[Path, typer.Option("--out", help="Directory to write keys/, creds/, tls/ and nats-auth.conf.")],
    hostnames: Annotated[
        Optional[list[str]], typer.Option("--hostname", help="Server certificate name (repeatable).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing trust chain.")] = False,
) -> None:
    """Create operator, accounts, signing keys, one creds file per role, a CA and a server certificate."""
    keys = out / "keys"
    if (keys / "operator.nk").exists() and not force:
        err.print(f"[yellow]{keys} already holds a trust chain; keeping it[/] (--force replaces it)")
        raise typer.Exit(0)
    auth = Authority.create()
    auth.save(keys)
    for role, perms in ROLE_PERMISSIONS.items():
        creds_files.write(out / "creds" / f"{role}.creds", auth.issue_user(role, perms))
    creds_files.write_secret(keys / "maas-gateway-issuer.json", auth.issuer().dump())
    tls = make_ca_and_server_cert(out / "tls", hostnames=tuple(hostnames or ("localhost", "nats")))
    # The resolver directory is the server's: a path inside its own data volume.
    (out / "nats-auth.conf").write_text(auth.server_config(Path("/data/resolver")))
    err.print(f"trust chain in {out}: CA {tls.ca}, {len(ROLE_PERMISSIONS)} role creds, nats-auth.conf")


@identities_app.command("onboard-host")
def onboard_host(
    node_id: Annotated[str, typer.Argument(help="Scheduler node id of the slice host.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the host's .creds file (mode 0600).")],
    keys_dir: KeysOpt = Path(".run/dev/keys"),
    admin_creds: Annotated[
        Optional[Path], typer.Option("--admin-creds", help="Admin creds to create the durable.")
    ] = None,
    nats_url: Annotated[Optional[str], typer.Option("--nats-url")] = None,
    ca_file: Annotated[Optional[Path], typer.Option("--ca-file")] = None,
    ttl_days: Annotated[float, typer.Option("--ttl-days")] = 365.0,
) -> None:
    """Issue the host's own NATS user and, with --nats-url, create its task durable."""
    auth = _load(keys_dir)
    creds = auth.issue_host(node_id, ttl_s=ttl_days * 86400)
    creds_files.write(out, creds)
    auth.save(keys_dir)
    err.print(f"{node_user_name(node_id)}: creds in {out} (0600), user {creds.claims['sub']}")
    if nats_url:
        asyncio.run(_create_durable(nats_url, node_id, admin_creds, ca_file))


@identities_app.command("decommission-host")
def decommission_host(
    node_id: Annotated[str, typer.Argument(help="Scheduler node id of the host.")],
    nats_url: Annotated[str, typer.Option("--nats-url", help="Any server of the cluster.")],
    keys_dir: KeysOpt = Path(".run/dev/keys"),
    ca_file: Annotated[Optional[Path], typer.Option("--ca-file")] = None,
    admin_creds: Annotated[
        Optional[Path],
        typer.Option("--admin-creds", help="Creds allowed on the revocation ledger (default: ../creds/admin.creds)."),
    ] = None,
) -> None:
    """Revoke every user issued to the host; its connections close at once."""
    from gpuaas_common.identity.tls import client_context
    from gpuaas_common.natsconn import split_servers

    auth = _load(keys_dir)
    users = auth.issued_hosts.get(node_id) or []
    if not users:
        err.print(f"[red]no users were issued to {node_id} from {keys_dir}[/]")
        raise typer.Exit(2)
    tls = client_context(ca_file) if ca_file else None
    admin = admin_creds or keys_dir.parent / "creds" / "admin.creds"

    async def revoke() -> int:
        import nats

        from gpuaas_common.natsconn import NatsIdentity

        ident = NatsIdentity(split_servers(nats_url), str(admin), str(ca_file) if ca_file else None)
        nc = await nats.connect(**ident.connect_kwargs(), connect_timeout=5, max_reconnect_attempts=2)
        try:
            return await auth.issuer().revoke(split_servers(nats_url), users, js=nc.jetstream(), tls=tls)
        finally:
            await nc.close()

    try:
        asyncio.run(revoke())
    except Exception as exc:
        err.print(f"[red]revocation failed[/]: {exc}")
        raise typer.Exit(1) from None
    err.print(f"{node_id}: {len(users)} user(s) revoked")


def _load(keys_dir: Path) -> Authority:
    try:
        return Authority.load(keys_dir)
    except (OSError, ValueError) as exc:
        err.print(f"[red]cannot read keys in {keys_dir}[/]: {exc}")
        raise typer.Exit(2) from None


async def _create_durable(nats_url: str, node_id: str, admin_creds: Optional[Path], ca_file: Optional[Path]) -> None:
    import nats

    from gpuaas_common.jetstream import ensure_consumer, node_agent_consumer
    from gpuaas_common.natsconn import NatsIdentity, split_servers

    ident = NatsIdentity(
        split_servers(nats_url), str(admin_creds) if admin_creds else None, str(ca_file) if ca_file else None
    )
    nc = await nats.connect(**ident.connect_kwargs(), connect_timeout=5, max_reconnect_attempts=2)
    try:
        outcome = await ensure_consumer(nc.jetstream(), node_agent_consumer(node_id))
        err.print(f"durable node-agent-{node_id}: {outcome}")
    finally:
        await nc.close()


@identities_app.command("provision")
def provision_bus(
    nats_url: Annotated[str, typer.Option("--nats-url", help="Any server of the cluster (comma-separated list ok).")],
    creds: Annotated[
        Path,
        typer.Option(
            "--creds",
            exists=True,
            dir_okay=False,
            help="Admin creds: only admin may create streams and hosts' durables.",
        ),
    ],
    ca_file: Annotated[Optional[Path], typer.Option("--ca-file", exists=True, dir_okay=False)] = None,
    fleet_file: Annotated[
        Optional[Path],
        typer.Option(
            "--fleet-file",
            exists=True,
            dir_okay=False,
            help="Also create the task durable of every slice host of this fleet.",
        ),
    ] = None,
    node_ids: Annotated[
        Optional[list[str]], typer.Option("--node-id", help="Also create this slice host's task durable (repeatable).")
    ] = None,
    replicas: Annotated[
        int,
        typer.Option(
            "--replicas",
            min=1,
            max=5,
            help="Copies of every stream and of the identity ledger: 3 on a 3-node cluster, 1 on one server.",
        ),
    ] = 1,
) -> None:
    """Create or update every stream and the slice hosts' task durables, as admin (idempotent).

    Services create only their own durables, hosts none: this is the step before either starts.
    """
    from gpuaas_common.fleet import Fleet

    hosts = list(node_ids or [])
    if fleet_file is not None:
        fleet = Fleet.load(fleet_file)
        hosts += [n.node_id for n in fleet.nodes if n.kind == "slice_host" and n.node_id not in hosts]
    try:
        outcome = asyncio.run(_provision(nats_url, creds, ca_file, hosts, replicas))
    except Exception as exc:  # refused, unreachable, or a stream the server would not accept
        err.print(f"[red]provisioning failed[/]: {exc}")
        raise typer.Exit(1) from None
    for what, result in outcome.items():
        err.print(f"{what}: {result}")


async def _provision(
    nats_url: str, creds: Path, ca_file: Optional[Path], node_ids: list[str], replicas: int = 1
) -> dict[str, str]:
    import nats

    from gpuaas_common.jetstream import node_agent_consumer, provision
    from gpuaas_common.natsconn import NatsIdentity, split_servers

    ident = NatsIdentity(split_servers(nats_url), str(creds), str(ca_file) if ca_file else None)
    nc = await nats.connect(
        **ident.connect_kwargs(), name="gpuaas-provision", connect_timeout=5, max_reconnect_attempts=3
    )
    try:
        return await provision(nc.jetstream(), [node_agent_consumer(n) for n in node_ids], replicas=replicas)
    finally:
        await nc.close()
