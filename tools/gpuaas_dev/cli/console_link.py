"""`gpuaas console`: the ops console's address and a login link for it, minted from the ops API's token (the
ops identity) of the selected stack, or the one given. The link is good for a few minutes and opens a session in
the first browser that follows it (once: a second use is refused); it is printed, never stored."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gpuaas_common.admin_http import login_link
from gpuaas_common.admin_http.login import LOGIN_TTL_S

from .admin_api import ActorOpt, actor_name, read_stack_json_file
from .common import DEFAULT_RUN_DIR, RunDirOpt, out
from .usage import OpsUrlOpt, TokenOpt, _endpoint

TtlOpt = Annotated[
    int, typer.Option("--valid-for", min=10, max=3600, help="Seconds the link signs in for (the session lasts 8 h).")
]


def console(
    actor: ActorOpt = None,
    valid_for: TtlOpt = int(LOGIN_TTL_S),
    ops_url: OpsUrlOpt = None,
    token: TokenOpt = None,
    run_dir: RunDirOpt = DEFAULT_RUN_DIR,
) -> None:
    """Print the ops console's URL and a login link (what you do there is audited under --actor).

    Example: gpuaas console --actor alice"""
    ep = _endpoint(ops_url, token, run_dir, 10.0)
    out.print(f"console  {ep.url}/console/", markup=False, soft_wrap=True)
    link = login_link(ep.url, ep.token, "ops", actor_name(actor), valid_for)
    out.print(f"login    {link}", markup=False, soft_wrap=True)


def console_lines(info: dict[str, Any]) -> list[str]:
    """For `gpuaas dev up`: the console's URL and a fresh login link for the developer, when the ops API is up."""
    url = info.get("ops_admin_url")
    secrets = read_stack_json_file(Path(info.get("secrets_file") or "")) if info.get("secrets_file") else None
    token = (secrets or {}).get("ops_admin_token")
    if not url or not token:
        return []
    link = login_link(url, token, "ops", actor_name(None))
    return [
        f"console   {url}/console/",
        f"login     {link}",
        f"          (valid {int(LOGIN_TTL_S // 60)} minutes; `gpuaas console` prints a fresh one)",
    ]
