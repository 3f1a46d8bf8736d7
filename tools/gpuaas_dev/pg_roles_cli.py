"""`gpuaas dev pg-roles`: create each service's Postgres role and schema (docker-compose's init step).

The dev stack calls `ensure_service_roles` itself; this command is for deployments that start the
services from a plain environment, where the passwords arrive as GPUAAS_PG_<SERVICE>_PASSWORD.
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

import typer
from rich.console import Console

err = Console(stderr=True, highlight=False)

# The compose file splices each password unescaped into the service's DSN, and a short one would be
# guessable: demand what `openssl rand -hex 24` gives.
_SAFE_PASSWORD = re.compile(r"^[A-Za-z0-9._~-]{16,}$")


def _password_opt(service: str) -> object:
    var = f"GPUAAS_PG_{service.upper().replace('-', '_')}_PASSWORD"
    return typer.Option(
        f"--{service}-password",
        envvar=var,
        show_default=False,
        help=f"Password of the {service} role; set it in the environment (argv is world-readable).",
    )


def pg_roles(
    admin_dsn: Annotated[
        str,
        typer.Option(
            "--admin-dsn",
            envvar="GPUAAS_PG_ADMIN_DSN",
            show_default=False,
            help="A superuser DSN (any database of the cluster).",
        ),
    ],
    database: Annotated[str, typer.Option("--database", envvar="GPUAAS_PG_DATABASE")] = "gpuaas",
    allocator: Annotated[str, _password_opt("allocator")] = "",
    scheduler: Annotated[str, _password_opt("scheduler")] = "",
    image_pipeline: Annotated[str, _password_opt("image-pipeline")] = "",
    maas_gateway: Annotated[str, _password_opt("maas-gateway")] = "",
    ops_view: Annotated[str, _password_opt("ops-view")] = "",
    replicas: Annotated[
        int,
        typer.Option(
            "--replicas",
            envvar="GPUAAS_PG_REPLICAS",
            min=1,
            help="Replicas per service that each role's CONNECTION LIMIT leaves room for (pool + dedicated ones).",
        ),
    ] = 4,
) -> None:
    """Create or update one login role per service that owns its schema and nothing else (idempotent)."""
    import asyncpg

    from gpuaas_common.pg_roles import SERVICE_ROLES, ensure_service_roles

    passwords = {
        "allocator": allocator,
        "scheduler": scheduler,
        "image-pipeline": image_pipeline,
        "maas-gateway": maas_gateway,
        "ops-view": ops_view,
    }
    weak = [service for service, password in passwords.items() if not _SAFE_PASSWORD.match(password)]
    if weak:
        names = ", ".join(f"GPUAAS_PG_{s.upper().replace('-', '_')}_PASSWORD" for s in weak)
        raise typer.BadParameter(
            f"{names}: empty or unsafe; use 16+ characters of [A-Za-z0-9._~-] (e.g. `openssl rand -hex 24`)"
        )
    try:
        asyncio.run(ensure_service_roles(admin_dsn, database, passwords, replicas=replicas))
    except (OSError, ValueError, asyncpg.PostgresError) as exc:
        err.print(f"[red]could not set up the Postgres roles[/]: {exc}")
        raise typer.Exit(1) from None
    for service in passwords:
        spec = SERVICE_ROLES[service]
        err.print(f"{service:15} role {spec.role:22} owns schema {spec.schema}")
