"""`gpuaas contract render`: the AsyncAPI contract rendered from the contract models."""

from typing import Annotated

import typer

from .common import err

contract_app = typer.Typer(no_args_is_help=True, help="The AsyncAPI contract.")


@contract_app.command("render")
def contract_render(
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 if the committed file differs; write nothing.")
    ] = False,
) -> None:
    """Render contracts/asyncapi.yaml from the contract models.

    Example: gpuaas contract render --check"""
    from gpuaas_common.contract.asyncapi import CONTRACT_PATH, render_yaml

    if not (CONTRACT_PATH.parents[1] / "pyproject.toml").exists():
        err.print("[red]run this from a source checkout[/] (an editable install): the contract lives in the repo")
        raise typer.Exit(2)
    rendered = render_yaml()
    current = CONTRACT_PATH.read_text() if CONTRACT_PATH.exists() else None
    if check:
        if current != rendered:
            err.print(f"[red]{CONTRACT_PATH.name} drifted from the contract models[/]; run `make contract`")
            raise typer.Exit(1)
        err.print(f"{CONTRACT_PATH.name} is up to date")
        return
    if current == rendered:
        err.print(f"{CONTRACT_PATH.name} unchanged")
        return
    CONTRACT_PATH.parent.mkdir(parents=True, exist_ok=True)
    CONTRACT_PATH.write_text(rendered)
    err.print(f"wrote {CONTRACT_PATH}")
