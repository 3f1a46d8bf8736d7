"""What the stack tells the outside: `stack.json` (how to reach it, no secrets) and `secrets.json` (mode 0600:
the MAAS API key, the enrolment secret, the admin API tokens and the database passwords)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuaas_common.pg_roles import dsn_without_password, service_database

from .database import DATABASE
from .lab_host import describe_lab
from .processes import MAAS_SIM

if TYPE_CHECKING:
    from .stack import Stack

# The services with an admin API -> the prefix of their keys: `<prefix>_admin_url` in stack.json,
# `<prefix>_admin_token` in secrets.json.
ADMIN_APIS: dict[str, str] = {"scheduler": "scheduler", "image-pipeline": "image", "ops-view": "ops"}


def describe_stack(stack: Stack) -> dict[str, Any]:
    """What a developer or the CLI needs to reach the stack; written to `run_dir/stack.json`.

    Never contains the MAAS API key or the enrolment secret (those live in `secrets.json`, mode 0600).
    """
    procs = {}
    for name, p in stack._procs.items():
        entry: dict[str, Any] = {
            "pid": p.pid if p.alive() else None,
            "running": p.alive(),
            "log": str(p.log_path),
            "restarts": p.restarts,
        }
        if name == MAAS_SIM:
            entry["port"] = p.port
        else:
            entry["health_port"] = p.port
            entry["readyz"] = f"http://127.0.0.1:{p.port}/readyz" if p.port else None
        procs[name] = entry
    info = {
        "status": stack.status,
        "run_dir": str(stack.run_dir),
        "supervisor_pid": os.getpid(),
        "nats_url": stack._nats.url if stack._nats else None,
        "nats_ca_file": str(stack._tls.ca) if stack._tls else None,
        "creds_dir": str(stack.creds_dir) if stack.auth else None,
        "nats_pids": [srv.proc.pid for srv in stack._nats.servers if srv.proc] if stack._nats else [],
        # The superuser's, on the maintenance database; each service's tables are in its own database.
        "database_url": dsn_without_password(stack._admin_dsn) if stack._admin_dsn else None,
        "service_databases": {s: service_database(DATABASE, s) for s in stack._service_dsns},
        "postgres_ca_file": str(stack.run_dir / "pg-tls" / "ca.pem") if stack.pg_tls else None,
        "maas_url": stack.maas_url if stack._procs.get(MAAS_SIM) and stack._procs[MAAS_SIM].port else None,
        # The CA that signed the simulator's HTTPS certificate (null: a plain-HTTP simulator a test asked for).
        "maas_ca_file": str(stack.maas_ca_file) if stack.maas_ca_file else None,
        "fleet_file": str(stack.run_dir / "fleet" / "fleet.json"),
        "registry_url": stack._registry.url if stack._registry else None,
        **{
            f"{prefix}_admin_url": f"http://127.0.0.1:{port}" if (port := stack.admin_port(service)) else None
            for service, prefix in ADMIN_APIS.items()
        },
        "lab": describe_lab(stack._lab, stack._lab_image, stack),
        "fleet": {
            "slice_hosts": stack.slice_hosts,
            "slots_per_host": stack.slots_per_host,
            "baremetal_hosts": stack.baremetal_hosts,
        },
        "services": procs,
        "secrets_file": str(stack.run_dir / "secrets.json"),
        "updated_at": time.time(),
    }
    if stack.run_dir.exists():
        tmp = stack.description_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(stack.description_file)
    return info


# The principals' secrets besides the admin APIs' own tokens (libs/gpuaas_common/admin_http/principals.py), one
# each, stored under these names in secrets.json: the billing export's token, the console's token at the scheduler,
# the console's login-link key.
PRINCIPAL_SECRETS = ("billing_token", "console_token", "console_login_secret")


def write_secrets(
    path: Path,
    *,
    maas_api_key: str,
    enrolment_secret: str,
    admin_tokens: dict[str, str],
    principal_secrets: dict[str, str] | None = None,
) -> None:
    """`admin_tokens` maps a service of ADMIN_APIS to its token, stored as `<prefix>_admin_token`
    (`scheduler_admin_token`, `image_admin_token`); `principal_secrets`, those of PRINCIPAL_SECRETS."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(
            {
                "maas_api_key": maas_api_key,
                "enrolment_secret": enrolment_secret,
                **{f"{ADMIN_APIS[service]}_admin_token": token for service, token in admin_tokens.items()},
                **(principal_secrets or {}),
            },
            f,
        )
    os.chmod(path, 0o600)


def record_database_secrets(path: Path, admin_dsn: str | None, service_dsns: dict[str, str]) -> None:
    # Added to what write_secrets wrote: database passwords live in this 0600 file, never in stack.json.
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.update(admin_database_url=admin_dsn, service_database_urls=service_dsns)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.chmod(path, 0o600)
