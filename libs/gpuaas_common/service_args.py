"""The command line every service binary shares: `--help`, `--version`, and a refusal of anything else.

A service is configured by its `GPUAAS_*` variables alone, so its arguments are only questions about it. They are
answered before any connection is tried: a binary asked for help must never sit out the start-up timeout
(runtime.py) waiting for a database. Each service's `entrypoints/console.py` calls this with nothing heavier than its
settings class imported, so the answer comes at once.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

from pydantic_settings import BaseSettings

DISTRIBUTION = "gpuaas"
# argparse's own code for a command line it refuses; shells and supervisors read 2 as a usage error.
EXIT_USAGE = 2


def package_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def field_comments(cls: type) -> dict[str, str]:
    """The comment lines right above each field of `cls`'s own body, joined: the code's own account of it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            comment: list[str] = []
            i = stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                comment.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            if comment:
                out[stmt.target.id] = " ".join(comment)
    return out


def settings_variables(settings_cls: type[BaseSettings]) -> list[tuple[str, str]]:
    """(variable, meaning) for every field, in the order the settings class declares them."""
    comments: dict[str, str] = {}
    # Base classes first, so that a subclass that redeclares a field gives its own meaning.
    for cls in reversed(settings_cls.__mro__):
        if isinstance(cls, type) and issubclass(cls, BaseSettings) and cls is not BaseSettings:
            comments.update(field_comments(cls))
    prefix = settings_cls.model_config.get("env_prefix", "")
    return [(f"{prefix}{name}".upper(), comments.get(name, "")) for name in settings_cls.model_fields]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, not argparse's usage block: a supervisor's log keeps the reason next to the exit code.
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(EXIT_USAGE)


def _environment_help(settings_cls: type[BaseSettings]) -> str:
    out = ["environment (every setting; the README's Configuration table gives types and defaults):"]
    for name, meaning in settings_variables(settings_cls):
        out.append(f"  {name}")
        if meaning:
            out.extend(textwrap.wrap(meaning, width=100, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(out)


def _commands_help(prog: str, commands: Mapping[str, str]) -> str:
    out = [f"commands (each with its own --help: {prog} COMMAND --help):"]
    width = max(map(len, commands), default=0)
    out.extend(f"  {name.ljust(width)}  {text}" for name, text in commands.items())
    return "\n".join(out)


def service_command_line(
    prog: str,
    summary: str,
    settings_cls: type[BaseSettings],
    *,
    argv: Sequence[str] | None = None,
    commands: Callable[[], Mapping[str, str]] | None = None,
) -> None:
    """Return only when the command line asks for nothing, i.e. the service is to run. `--help` and `--version`
    print their answer and exit 0; anything else exits 2 with one line on stderr. `commands` lists the
    subcommands a binary hands to another parser (only asked for when help is printed)."""

    class _Help(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
            parts = [parser.format_help().rstrip()]
            if commands is not None:
                parts.append(_commands_help(prog, commands()))
            parts.append(_environment_help(settings_cls))
            print("\n\n".join(parts))
            parser.exit(0)

    parser = _Parser(
        prog=prog,
        description=f"{summary} Without arguments it runs the service, configured only by the GPUAAS_* environment "
        "variables below.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        add_help=False,
    )
    parser.add_argument("-h", "--help", action=_Help, nargs=0, help="show this help and exit")
    parser.add_argument("--version", action="version", version=f"{prog} {package_version()}")
    parser.parse_args(sys.argv[1:] if argv is None else list(argv))


def service_main(prog: str, summary: str, settings_cls: type[BaseSettings], run: str) -> None:
    """A service binary's console entry point: answer the command line, then import `run` ("module:function",
    the service's heavy main) only when the service is really to run."""
    service_command_line(prog, summary, settings_cls)
    module, _, function = run.partition(":")
    getattr(import_module(module), function)()
