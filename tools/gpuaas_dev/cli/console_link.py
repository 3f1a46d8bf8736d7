"""`gpuaas console`: the ops console's address and a login link for it, minted from the console's login secret
(its own, none of the bearer tokens) of the selected stack, or the one given, for one person and the rights they
sign in with (`ops`: read; `ops-admin`: the console's changes too). The link is good for a few minutes and opens a
session in the first browser that follows it (once: a second use is refused); it is printed, never stored."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from gpuaas_common.admin_http import login_link
from gpuaas_common.admin_http.login import LOGIN_TTL_S

from .admin_api import ActorOpt, actor_name, read_stack_json_file
from .common import DEFAULT_RUN_DIR, RunDirOpt, out
from .usage import OpsUrlOpt, _endpoint

TtlOpt = Annotated[
    int, typer.Option("--valid-for", min=10, max=3600, help="Seconds the link signs in for (the session lasts 8 h).")
]
SecretOpt = Annotated[
    Optional[str],
    typer.Option(
        "--login-secret",
        envvar="GPUAAS_CONSOLE_LOGIN_SECRET",
        show_envvar=False,
        help="The console's login secret. Default: $GPUAAS_CONSOLE_LOGIN_SECRET, else the selected stack's "
        "secrets.json (console_login_secret).",
    ),
]


class Rights(str, Enum):
    ops = "ops"
    ops_admin = "ops-admin"


RightsOpt = Annotated[
    Rights,
    typer.Option("--rights", help="ops: read the console; ops-admin: also drain, approve, repair, set quotas."),
]


def console(
    actor: ActorOpt = None,
    rights: RightsOpt = Rights.ops,
    valid_for: TtlOpt = int(LOGIN_TTL_S),
    ops_url: OpsUrlOpt = None,
    login_secret: SecretOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Print the ops console's URL and a login link (what you do there is audited under --actor).

    Example: gpuaas console --actor alice --rights ops-admin"""
    given = "pass --ops-url and --login-secret (or $GPUAAS_OPS_ADMIN_URL and $GPUAAS_CONSOLE_LOGIN_SECRET)"
    ep = _endpoint(ops_url, login_secret, run_dir, 10.0, "console_login_secret", given)
    out.print(f"console  {ep.url}/console/", markup=False, soft_wrap=True)
    link = login_link(ep.url, ep.token, rights.value, actor_name(actor), valid_for)
    out.print(f"login    {link}", markup=False, soft_wrap=True)


def console_lines(info: dict[str, Any]) -> list[str]:
    """For `gpuaas dev up`: the console's URL and a fresh read-only login link for the developer, when the ops API
    is up."""
    url = info.get("ops_admin_url")
    secrets = read_stack_json_file(Path(info.get("secrets_file") or "")) if info.get("secrets_file") else None
    secret = (secrets or {}).get("console_login_secret")
    if not url or not secret:
        return []
    link = login_link(url, secret, "ops", actor_name(None))
    return [
        f"console   {url}/console/",
        f"login     {link}",
        f"          (read only, valid {int(LOGIN_TTL_S // 60)} minutes; `gpuaas console --rights ops-admin` prints "
        "one that may change things)",
    ]
