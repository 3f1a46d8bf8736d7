"""The README sections that are made from the code: the configuration tables (from the settings classes and the
CLI's environment options), the CLI table (from the typer app) and the metrics table (from the metric definitions,
`gpuaas_dev.metrics_catalog`).

    .venv/bin/python -m gpuaas_dev.docs           # rewrite the generated sections of README.md
    .venv/bin/python -m gpuaas_dev.docs --check   # exit 1 if README.md differs from the code

Each section sits between `<!-- BEGIN generated:NAME -->` and `<!-- END generated:NAME -->`; the text around them
is written by hand. tests/contract/test_docs.py fails on drift.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

# Re-exported: the README table and the service binaries' --help read the same comments.
from gpuaas_common.service_args import field_comments  # noqa: F401

README = Path(__file__).resolve().parents[2] / "README.md"


@dataclass(frozen=True)
class SettingsOf:
    """A settings class and the processes that read it."""

    path: str  # module.Class
    read_by: str

    def load(self) -> type[BaseModel]:
        module, _, name = self.path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, BaseModel)
        return cls


# In the order the README lists them; a subclass documents only the fields it adds.
SETTINGS: tuple[SettingsOf, ...] = (
    SettingsOf("gpuaas_common.settings.ServiceSettings", "every service"),
    SettingsOf("gpuaas_allocator.settings.AllocatorSettings", "allocator"),
    SettingsOf("gpuaas_scheduler.settings.SchedulerSettings", "scheduler"),
    SettingsOf("gpuaas_image_pipeline.settings.ImagePipelineSettings", "image-pipeline"),
    SettingsOf("gpuaas_maas_gateway.settings.GatewaySettings", "maas-gateway"),
    SettingsOf("gpuaas_ops_view.settings.OpsViewSettings", "ops-view"),
    SettingsOf("gpuaas_credential_authority.settings.AuthoritySettings", "credential-authority"),
    SettingsOf("gpuaas_node_agent.settings.AgentSettings", "node-agent, sim-fleet"),
    SettingsOf("gpuaas_dev.sim.settings.SimFleetSettings", "sim-fleet"),
)

# Console script -> the settings class its process reads (docker-compose and the dev stack run these).
SETTINGS_BY_SCRIPT: dict[str, str] = {
    "gpuaas-allocator": "gpuaas_allocator.settings.AllocatorSettings",
    "gpuaas-scheduler": "gpuaas_scheduler.settings.SchedulerSettings",
    "gpuaas-image-pipeline": "gpuaas_image_pipeline.settings.ImagePipelineSettings",
    "gpuaas-maas-gateway": "gpuaas_maas_gateway.settings.GatewaySettings",
    "gpuaas-ops-view": "gpuaas_ops_view.settings.OpsViewSettings",
    "gpuaas-credential-authority": "gpuaas_credential_authority.settings.AuthoritySettings",
    "gpuaas-node-agent": "gpuaas_node_agent.settings.AgentSettings",
    "gpuaas-sim-fleet": "gpuaas_dev.sim.settings.SimFleetSettings",
}

ENV_PREFIX = "GPUAAS_"

LIST_FORMAT = (
    "A *list* takes comma-separated values (`GPUAAS_RETRY_DELAYS_S=0.2,0.5,1`) or a JSON array "
    '(`[0.2,0.5,1]`, `["focal","noble"]`); an empty value is the empty list. A *JSON object* takes JSON only. '
    "A *secret* prints masked. Durations (`…_S`) are in seconds."
)


# --- settings ------------------------------------------------------------------------------------------------


def _own_fields(cls: type[BaseModel]) -> list[str]:
    own = cls.__dict__.get("__annotations__", {})
    return [name for name in cls.model_fields if name in own]


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (tuple, list, set, frozenset)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        named = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (", optional" if type(None) in args else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if _is_list(annotation):
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        value = args[1]
        if isinstance(value, type) and issubclass(value, BaseModel):
            keys = ", ".join(value.model_fields)
            return f"JSON object: name → {{{keys}}}"
        return "JSON object"
    if annotation is SecretStr:
        return "secret"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, str(annotation))


_BOUNDS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("min_length", "length ≥"), ("max_length", "length ≤"))


def _constraints(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {_number(value)}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _number(value: float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f" (= {int(seconds // size)} {unit})"
    return ""


def _default(name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        value = {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in value.items()}
        return f"`{json.dumps(value, separators=(',', ':'))}`" if value else "`{}`"
    if isinstance(value, (tuple, list)):
        return f"`{','.join(_number(v) if isinstance(v, float) else str(v) for v in value)}`" if value else "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{_number(value)}`" + (_duration(value) if name.endswith("_s") else "")
    return f"`{value}`" if value != "" else '`""`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_rows() -> Iterator[tuple[str, str, str, str, str]]:
    for entry in SETTINGS:
        cls = entry.load()
        comments = field_comments(cls)
        for name in _own_fields(cls):
            field = cls.model_fields[name]
            kind = _type_name(field.annotation)
            bounds = _constraints(field)
            meaning = field.description or comments.get(name, "")
            yield (
                f"`{ENV_PREFIX}{name.upper()}`",
                entry.read_by,
                kind + (f" ({bounds})" if bounds else ""),
                _default(name, field),
                meaning,
            )


def config_section() -> str:
    rows = ["| variable | read by | type | default | meaning |", "|---|---|---|---|---|"]
    rows += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in settings_rows()]
    env_rows = ["| variable | command | option |", "|---|---|---|"]
    for var, commands, option in cli_env_rows():
        env_rows.append(f"| `{var}` | {', '.join(f'`{c}`' for c in commands)} | `{option}` |")
    return "\n".join(
        [
            LIST_FORMAT,
            "",
            *rows,
            "",
            "`gpuaas` commands read these options from the environment too:",
            "",
            *env_rows,
        ]
    )


# --- CLI -------------------------------------------------------------------------------------------------------


def _walk(cmd: Any, ctx: Any, path: list[str]) -> Iterator[tuple[list[str], Any, Any]]:
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or getattr(sub, "hidden", False):
                continue
            yield from _walk(sub, type(ctx)(sub, info_name=name, parent=ctx), [*path, name])
    else:
        yield path, cmd, ctx


def cli_commands() -> Iterator[tuple[list[str], Any, Any]]:
    """(path, command, context) of every leaf command of `gpuaas`, in the order `--help` lists them."""
    import typer

    from gpuaas_dev.cli import app

    root = typer.main.get_command(app)
    yield from _walk(root, root.context_class(root, info_name="gpuaas"), ["gpuaas"])


def _is_option(param: Any) -> bool:
    return bool(getattr(param, "opts", None)) and param.opts[0].startswith("-")


def _synopsis(path: list[str], cmd: Any) -> str:
    parts = [" ".join(path)]
    for param in cmd.params:
        if getattr(param, "hidden", False) or not getattr(param, "expose_value", True):
            continue
        if _is_option(param):
            name = max(param.opts, key=len)
            metavar = param.metavar or name.lstrip("-").upper().replace("-", "_")
            text = name if param.is_flag else f"{name} {metavar}"
            if param.secondary_opts:
                text = f"{name}/{max(param.secondary_opts, key=len)}"
        else:
            text = (param.metavar or param.name).upper()
        if param.multiple or (not _is_option(param) and param.nargs == -1):
            text += "…"
        parts.append(text if param.required else f"[{text}]")
    return " ".join(parts)


def _help(cmd: Any) -> str:
    text = inspect.cleandoc(cmd.help or "")
    # Typer shows the docstring up to a `\f` line; each paragraph is joined into one line of the table.
    text = text.split("\f", 1)[0]
    return " ".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip())


def cli_section() -> str:
    rows = ["| command | what it does (its `--help`) |", "|---|---|"]
    for path, cmd, _ in cli_commands():
        rows.append(f"| `{_cell(_synopsis(path, cmd))}` | {_cell(_help(cmd))} |")
    return "\n".join(rows)


def cli_env_rows() -> list[tuple[str, list[str], str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path, cmd, _ in cli_commands():
        for param in cmd.params:
            envvars = param.envvar if isinstance(param.envvar, (list, tuple)) else [param.envvar]
            for var in envvars:
                if var and _is_option(param):
                    found.setdefault((var, max(param.opts, key=len)), []).append(" ".join(path))
    return [(var, commands, option) for (var, option), commands in sorted(found.items())]


# --- README ------------------------------------------------------------------------------------------------------


def metrics_section() -> str:
    from .metrics_catalog import metrics_section as render_metrics

    return render_metrics()


SECTIONS: dict[str, Callable[[], str]] = {"config": config_section, "cli": cli_section, "metrics": metrics_section}


def _markers(name: str) -> tuple[str, str]:
    return (
        f"<!-- BEGIN generated:{name} (`.venv/bin/python -m gpuaas_dev.docs`; do not edit by hand) -->",
        f"<!-- END generated:{name} -->",
    )


def render(readme: str) -> str:
    for name, make in SECTIONS.items():
        begin, end = _markers(name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
        if not pattern.search(readme):
            raise ValueError(f"README has no generated:{name} section ({begin!r} … {end!r})")
        match = pattern.search(readme)
        assert match is not None
        readme = f"{readme[: match.start()]}{begin}\n{make()}\n{end}{readme[match.end() :]}"
    return readme


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    current = README.read_text()
    wanted = render(current)
    if wanted == current:
        return 0
    if check:
        print("README.md differs from the code: run `.venv/bin/python -m gpuaas_dev.docs`", file=sys.stderr)
        return 1
    README.write_text(wanted)
    print("README.md: generated sections rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
