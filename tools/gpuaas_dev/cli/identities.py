"""`gpuaas identities …`: the bus's trust chain for a deployment, and host onboarding/decommissioning.

`init` writes a directory (keys 0600, one `.creds` per role, a CA and server certificate, and the
operator-mode block of the NATS config) — docker-compose's init step and any deployment without its
own PKI use it. `onboard-host` is what ops run when a slice host joins: its own user in a 0600 creds
file and its task durable. `renew` issues again, at half-life, the role and slice-host files whose users
live hours to days (compose's `identities-renewer` runs it with `--every`); the processes reading them
switch without a gap. `decommission-host` revokes every user ever issued to the host, at once, without
restarting a server.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from gpuaas_common.identity import Authority
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.authority import DEFAULT_USER_TTL_S, HOST_USER_TTL_S, MAX_USER_TTL_S
from gpuaas_common.identity.permissions import (
    ADMIN,
    AUTHORITY,
    ROLE_PERMISSIONS,
    inbox_prefix,
    node_user_name,
    render_table,
)
from gpuaas_common.identity.rotation import host_files, renew_host_files, renew_role_files
from gpuaas_common.identity.tls import issue_server_cert, make_ca_and_server_cert

from .common import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, err, fail

identities_app = typer.Typer(no_args_is_help=True, help="Bus identities: keys, creds, host onboarding.")

KeysOpt = Annotated[Path, typer.Option("--keys-dir", help="Directory of the deployment's keys (0700).")]


@identities_app.command("table")
def table() -> None:
    """Print who may publish and subscribe what (the README's table, rendered from the code).

    Example: gpuaas identities table > identities.md"""
    print(render_table(), end="")


@identities_app.command("init")
def init(
    out: Annotated[Path, typer.Option("--out", help="Directory to write keys/, creds/, tls/ and nats-auth.conf.")],
    hostnames: Annotated[
        Optional[list[str]], typer.Option("--hostname", help="Server certificate name (repeatable).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing trust chain.")] = False,
) -> None:
    """Create operator, accounts, signing keys, one creds file per role, a CA and a server certificate.

    Example: gpuaas identities init --out deploy/identities --hostname nats.example.internal"""
    keys = out / "keys"
    if (keys / "operator.nk").exists() and not force:
        # Admin lives hours: each run of the deployment's init (compose runs it before provisioning) mints
        # the one-shot steps that follow a fresh one from the kept keys.
        kept = _load(keys)
        creds_files.write(out / "creds" / f"{ADMIN}.creds", kept.issue_user(ADMIN, ROLE_PERMISSIONS[ADMIN]))
        _authority_files(out, kept)
        # Roles live a day: after a stop longer than half of that, the services start with fresh files.
        renewed = renew_role_files(kept, out / "creds")
        err.print(
            f"[yellow]{keys} already holds a trust chain; keeping it[/] (--force replaces it); fresh admin creds"
            + (f", renewed: {', '.join(renewed)}" if renewed else "")
        )
        raise typer.Exit(0)
    auth = Authority.create()
    auth.save(keys)
    for role, perms in ROLE_PERMISSIONS.items():
        creds_files.write(out / "creds" / f"{role}.creds", auth.issue_user(role, perms))
    tls = make_ca_and_server_cert(out / "tls", hostnames=tuple(hostnames or ("localhost", "nats")))
    _authority_files(out, auth)
    # The resolver directory is the server's: a path inside its own data volume.
    (out / "nats-auth.conf").write_text(auth.server_config(Path("/data/resolver")))
    err.print(f"trust chain in {out}: CA {tls.ca}, {len(ROLE_PERMISSIONS)} role creds, nats-auth.conf")


CA_KEY = "ca-key.pem"


def _authority_files(out: Path, auth: Authority) -> None:
    """The credential authority's creds and HTTPS certificate, where a trust chain made before it lacks them
    (an upgrade: the gateway's old issuer file, the signing keys in a bus service's hands, is removed)."""
    role_file = out / "creds" / f"{AUTHORITY}.creds"
    if not role_file.exists():
        creds_files.write(role_file, auth.issue_user(AUTHORITY, ROLE_PERMISSIONS[AUTHORITY]))
    kept_key = out / "keys" / CA_KEY
    if not (out / "tls" / f"{AUTHORITY}.pem").exists():
        ca_key = kept_key if kept_key.exists() else None
        issue_server_cert(out / "tls", AUTHORITY, hostnames=(AUTHORITY, "localhost"), ca_key_file=ca_key)
    (out / "keys" / "maas-gateway-issuer.json").unlink(missing_ok=True)
    # The CA's key goes with the other keys: the tls directory is every bus client's and every server's to read.
    beside = out / "tls" / CA_KEY
    if beside.exists():
        creds_files.write_secret(kept_key, beside.read_text())
        beside.unlink()


@identities_app.command("handout")
def handout(
    creds_dir: Annotated[Path, typer.Option("--creds-dir", help="The creds directory `init` wrote.")],
    to: Annotated[
        list[str],
        typer.Option("--to", help="ROLE=DIR[:USER]: ROLE's creds file into DIR (its reader's volume), USER's."),
    ],
) -> None:
    """Hand each role's creds file to its reader: moved into a directory only that reader mounts (given to USER,
    0600), a link left in its place so renewal writes it there (idempotent).

    Example: gpuaas identities handout --creds-dir /identities/creds --to allocator=/handout/allocator:nobody"""
    import pwd

    for item in to:
        role, _, rest = item.partition("=")
        where, _, user = rest.partition(":")
        if not role or not where or role not in ROLE_PERMISSIONS:
            raise fail(f"[red]--to {item}[/]: ROLE=DIR[:USER] with a known role", EXIT_USAGE)
        owner = None
        if user:
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                raise fail(f"[red]--to {item}[/]: no user {user}", EXIT_USAGE) from None
            owner = (entry.pw_uid, entry.pw_gid)
        path = creds_dir / f"{role}.creds"
        if not path.exists() and not path.is_symlink():
            raise fail(f"[red]no creds file for {role}[/] in {creds_dir}", EXIT_USAGE)
        dest = creds_files.hand_out(path, Path(where), owner=owner)
        err.print(f"{role}: {dest}" + (f" ({user})" if user else ""))


@identities_app.command("onboard-host")
def onboard_host(
    node_id: Annotated[str, typer.Argument(help="Scheduler node id of the slice host.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the host's .creds file (mode 0600).")],
    keys_dir: KeysOpt = Path(".run/dev/keys"),
    admin_creds: Annotated[
        Optional[Path], typer.Option("--admin-creds", help="Admin creds to create the durable.")
    ] = None,
    nats_url: Annotated[
        Optional[str], typer.Option("--nats-url", help="Also create the host's task durable on this bus.")
    ] = None,
    ca_file: Annotated[Optional[Path], typer.Option("--ca-file", help="CA of the bus's TLS certificate.")] = None,
    ttl_days: Annotated[
        float,
        typer.Option(
            "--ttl-days",
            min=0.01,
            max=MAX_USER_TTL_S / 86400,
            help="Days until the host's user expires (`identities renew` issues it again at half-life).",
        ),
    ] = HOST_USER_TTL_S / 86400,
) -> None:
    """Issue the host's own NATS user and, with --nats-url, create its task durable (the bus is reached first:
    an unreachable bus leaves no creds file and no issued user behind).

    Example: gpuaas identities onboard-host slice-05 --out slice-05.creds --nats-url tls://nats:4222"""
    auth = _load(keys_dir)
    if nats_url:
        ident = _identity(nats_url, admin_creds, ca_file)
        asyncio.run(_onboard_on_bus(auth, node_id, out, keys_dir, ident, ttl_days))
    else:
        _issue_host(auth, node_id, out, keys_dir, ttl_days)
        err.print(
            f"[yellow]{node_user_name(node_id)} is not recorded on the bus[/]: without --nats-url the gateway cannot "
            "revoke it before the host is deployed for a tenant; run onboard-host with --nats-url"
        )


def _issue_host(auth: Authority, node_id: str, out: Path, keys_dir: Path, ttl_days: float) -> None:
    creds = auth.issue_host(node_id, ttl_s=ttl_days * 86400)
    try:
        creds_files.write(out, creds)
    except OSError as exc:
        raise fail(f"[red]cannot write {out}[/]: {exc.strerror or exc}", EXIT_USAGE) from None
    auth.save(keys_dir)
    err.print(f"{node_user_name(node_id)}: creds in {out} (0600), user {creds.claims['sub']}")


@identities_app.command("renew")
def renew(
    out: Annotated[Path, typer.Option("--out", help="The directory `init` wrote: keys/ and creds/ inside.")],
    hosts_dir: Annotated[
        Optional[Path], typer.Option("--hosts-dir", help="Also renew the slice hosts' creds files in it.")
    ] = None,
    nats_url: Annotated[
        Optional[str], typer.Option("--nats-url", help="The bus, where renewed host users are recorded.")
    ] = None,
    ca_file: Annotated[Optional[Path], typer.Option("--ca-file", help="CA of the bus's TLS certificate.")] = None,
    ttl_hours: Annotated[
        float, typer.Option("--ttl-hours", min=0.01, max=24 * 30, help="Lifetime of a renewed role user.")
    ] = DEFAULT_USER_TTL_S / 3600,
    host_ttl_hours: Annotated[
        float, typer.Option("--host-ttl-hours", min=0.01, max=24 * 30, help="Lifetime of a renewed host user.")
    ] = HOST_USER_TTL_S / 3600,
    every: Annotated[float, typer.Option("--every", min=0, help="Run again every this many seconds (0: once).")] = 0.0,
) -> None:
    """Issue again every role's and slice host's creds file past half its lifetime (admin is never renewed:
    no running process holds it); the processes reading them switch without a gap. A renewed file keeps the
    owner of the one it replaces.

    A host is renewed only while its user is live and not revoked (a host whose slice life ended comes back
    through onboard-host), its new user recorded on the bus before its file is written.

    Example: gpuaas identities renew --out /identities --hosts-dir /identities/hosts --nats-url tls://nats:4222
    --ca-file /identities/tls/ca.pem --every 600"""
    if hosts_dir is not None and not nats_url:
        raise fail("[red]--hosts-dir needs --nats-url[/]: a renewed host user is recorded on the bus", EXIT_USAGE)
    ident = _identity(nats_url, None, ca_file) if nats_url else None
    while True:
        auth = _load(out / "keys")
        roles = renew_role_files(auth, out / "creds", ttl_s=ttl_hours * 3600)
        hosts: dict[str, str] = {}
        if hosts_dir is not None and ident is not None:
            try:
                hosts = asyncio.run(_renew_hosts(auth, ident, hosts_dir, host_ttl_hours * 3600))
            except Exception as exc:  # the bus away: the next round tries again; hosts have half a life left
                if not every:
                    raise fail(f"[red]hosts not renewed[/]: {_one_line(exc)}", EXIT_UNREACHABLE) from None
                err.print(f"[red]hosts not renewed[/]: {_one_line(exc)}")
            auth.save(out / "keys")
        renewed = roles + [node for node, outcome in hosts.items() if outcome == "renewed"]
        left = {node: outcome for node, outcome in hosts.items() if outcome != "renewed"}
        err.print(
            f"renewed: {', '.join(renewed) or 'nothing due'}"
            + (f"; left alone: {', '.join(f'{n} ({o})' for n, o in left.items())}" if left else "")
        )
        if not every:
            return
        time.sleep(every)


async def _renew_hosts(auth: Authority, ident: Any, hosts_dir: Path, ttl_s: float) -> dict[str, str]:
    """As a short-lived admin minted for this round from the keys: no admin file is written or read."""
    import nats
    from nats.aio.client import RawCredentials

    kw = ident.connect_kwargs()
    admin = auth.issue_user(ADMIN, ROLE_PERMISSIONS[ADMIN], ttl_s=600)
    kw.update(user_credentials=RawCredentials(admin.render()), inbox_prefix=inbox_prefix(ADMIN).encode())
    nc = await nats.connect(**kw, connect_timeout=5, max_reconnect_attempts=3, name="gpuaas-identities-renew")
    try:
        tls = ident.tls_context()
        return await renew_host_files(
            auth,
            host_files(hosts_dir),
            js=nc.jetstream(),
            nats_servers=ident.servers,
            tls=tls,
            ttl_s=ttl_s,
        )
    finally:
        await nc.close()


@identities_app.command("decommission-host")
def decommission_host(
    node_id: Annotated[str, typer.Argument(help="Scheduler node id of the host.")],
    nats_url: Annotated[str, typer.Option("--nats-url", help="Any server of the cluster.")],
    keys_dir: KeysOpt = Path(".run/dev/keys"),
    ca_file: Annotated[Optional[Path], typer.Option("--ca-file", help="CA of the bus's TLS certificate.")] = None,
    admin_creds: Annotated[
        Optional[Path],
        typer.Option("--admin-creds", help="Creds allowed on the revocation ledger (default: ../creds/admin.creds)."),
    ] = None,
) -> None:
    """Revoke every user issued to the host; its connections close at once (exit 1 if none was issued).

    Example: gpuaas identities decommission-host slice-05 --nats-url tls://nats:4222 --ca-file tls/ca.pem"""
    from gpuaas_common.identity.tls import client_context
    from gpuaas_common.natsconn import split_servers

    auth = _load(keys_dir)
    users = auth.issued_hosts.get(node_id) or []
    if not users:
        raise fail(f"[red]no host {node_id}[/]: no user was issued to it from {keys_dir}", EXIT_FAILED)
    tls = client_context(ca_file) if ca_file else None
    admin = admin_creds or keys_dir.parent / "creds" / "admin.creds"

    ident = _identity(nats_url, admin, ca_file)

    async def revoke() -> int:
        nc = await _connect(ident)
        try:
            return await auth.issuer().revoke(split_servers(nats_url), users, js=nc.jetstream(), tls=tls)
        except Exception as exc:  # refused by the ledger or the system account: nothing was revoked
            raise fail(f"[red]revocation failed[/]: {_one_line(exc)}", EXIT_FAILED) from None
        finally:
            await nc.close()

    asyncio.run(revoke())
    err.print(f"{node_id}: {len(users)} user(s) revoked")


def _load(keys_dir: Path) -> Authority:
    try:
        return Authority.load(keys_dir)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _one_line(exc)
        raise fail(f"[red]cannot read keys in {keys_dir}[/]: {reason}", EXIT_USAGE) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _identity(nats_url: str, creds: Optional[Path], ca_file: Optional[Path]) -> Any:
    from gpuaas_common.natsconn import InsecureTransport, NatsIdentity, split_servers

    from ..identity_cli import checked_identity, insecure_dev

    if creds is not None and not creds.is_file():
        raise fail(f"[red]no such creds file: {creds}[/]", EXIT_UNREACHABLE)
    ident = NatsIdentity(
        split_servers(nats_url),
        str(creds) if creds else None,
        str(ca_file) if ca_file else None,
        insecure_dev=insecure_dev(),
    )
    bad = [s for s in ident.servers if not s.startswith(("nats://", "tls://"))]
    if bad:
        raise fail(f"[red]bad NATS URL {bad[0]!r}[/]: expected nats://host:port or tls://host:port", EXIT_UNREACHABLE)
    try:
        return checked_identity(ident)
    except InsecureTransport as exc:
        raise fail(f"[red]refused to connect[/]: {exc}", EXIT_USAGE) from None


async def _connect(ident: Any) -> Any:
    """A bus that is not there or refuses the creds ends the command with one line and exit 3."""
    from .bus import connect

    return await connect(ident)


async def _onboard_on_bus(
    auth: Authority,
    node_id: str,
    out: Path,
    keys_dir: Path,
    ident: Any,
    ttl_days: float,
) -> None:
    from gpuaas_common.identity.authority import record_host_users
    from gpuaas_common.jetstream import ensure_consumer, node_agent_consumer

    nc = await _connect(ident)
    try:
        _issue_host(auth, node_id, out, keys_dir, ttl_days)
        try:
            # Recorded before the durable: a host whose user the gateway cannot find could be deployed for a
            # tenant with its slice identity still alive.
            await record_host_users(nc.jetstream(), node_id, auth.issued_hosts[node_id], expiry=auth.host_expiry)
            outcome = await ensure_consumer(nc.jetstream(), node_agent_consumer(node_id))
        except Exception as exc:  # refused or no NODE_TASKS stream: the creds stand, the durable does not
            raise fail(
                f"[red]durable node-agent-{node_id} not created[/]: {_one_line(exc)} (run onboard-host again as admin)",
                EXIT_FAILED,
            ) from None
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
    ca_file: Annotated[
        Optional[Path], typer.Option("--ca-file", exists=True, dir_okay=False, help="CA of the bus's TLS certificate.")
    ] = None,
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
    """Create or update every stream, every service's durable and the slice hosts' task durables, as admin
    (idempotent). Services and hosts only bind: this is the step before either starts.

    Example: gpuaas identities provision --nats-url tls://nats:4222 --creds creds/admin.creds --replicas 3
    """
    from gpuaas_common.fleet import Fleet

    hosts = list(node_ids or [])
    if fleet_file is not None:
        fleet = Fleet.load(fleet_file)
        hosts += [n.node_id for n in fleet.nodes if n.kind == "slice_host" and n.node_id not in hosts]
    outcome = asyncio.run(_provision(_identity(nats_url, creds, ca_file), hosts, replicas))
    for what, result in outcome.items():
        err.print(f"{what}: {result}")


async def _provision(ident: Any, node_ids: list[str], replicas: int = 1) -> dict[str, str]:
    from gpuaas_common.jetstream import node_agent_consumer, provision

    nc = await _connect(ident)
    try:
        return await provision(nc.jetstream(), [node_agent_consumer(n) for n in node_ids], replicas=replicas)
    except Exception as exc:  # a stream the server would not accept, or creds that may not provision
        raise fail(f"[red]provisioning failed[/]: {_one_line(exc)}", EXIT_FAILED) from None
    finally:
        await nc.close()
