"""What the Dockerfile builds from pyproject.toml, with the standard library alone (it runs in the base image).

`requirements PYPROJECT OUT_DIR`: OUT_DIR/build.txt (the build backend) and OUT_DIR/runtime.txt (the project's
dependencies), one requirement a line. They change only when those lists do, so the layer that builds the
dependency wheels from them is rebuilt only then.

`runtime PYPROJECT OUT`: the pyproject.toml of the runtime image's wheel, the same project without the packages
of the dev tools (`tools/`: the `gpuaas` CLI, the simulators, the test servers) and without the console scripts
that would point into them.

`check-runtime DIST PACKAGE…`: in the built image, none of the packages is importable and every console script of
the distribution loads. Exits 1 saying what is wrong.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

# The source folders (pyproject's packages.find `where`) of the tools a production image does without.
DEV_WHERE = ("tools",)


def requirements(project: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(build backend, runtime dependencies) as pip requirement lines."""
    return list(project["build-system"]["requires"]), list(project["project"]["dependencies"])


def _top_packages(root: Path, where: str) -> set[str]:
    """The packages setuptools finds directly under a `where` folder (namespace packages included)."""
    folder = root / where
    if not folder.is_dir():
        return set()
    return {p.name for p in folder.iterdir() if p.is_dir() and p.name.isidentifier()}


def runtime_project(project: dict[str, Any], root: Path) -> dict[str, Any]:
    """The packaging tables of pyproject.toml for the runtime wheel (every other `tool` table is left out)."""
    setuptools = project["tool"]["setuptools"]
    find = dict(setuptools["packages"]["find"])
    where = list(find["where"])
    missing = [w for w in DEV_WHERE if w not in where]
    if missing:
        raise SystemExit(f"packaging: pyproject.toml's packages.find has no {missing}: update {__file__}")
    dropped = set().union(*(_top_packages(root, w) for w in DEV_WHERE))
    find["where"] = [w for w in where if w not in DEV_WHERE]
    scripts = {
        name: target
        for name, target in project["project"].get("scripts", {}).items()
        if target.split(":", 1)[0].split(".", 1)[0] not in dropped
    }
    return {
        "build-system": project["build-system"],
        "project": {**project["project"], "scripts": scripts},
        "tool": {"setuptools": {**setuptools, "packages": {**setuptools["packages"], "find": find}}},
    }


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(name: str) -> str:
    return name if _BARE_KEY.match(name) else json.dumps(name)


def _value(value: Any) -> str:
    # A JSON string is a TOML basic string; booleans and integers are written alike.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int)):
        return json.dumps(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, bool)) for v in value):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise SystemExit(f"packaging: cannot write {value!r} as TOML here")


def dumps(tables: dict[str, Any]) -> str:
    """TOML for nested tables of strings, integers, booleans and lists of them (what the packaging tables hold)."""
    out: list[str] = []

    def table(path: list[str], data: dict[str, Any]) -> None:
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
        if path and (scalars or not data):
            out.append("[" + ".".join(_key(p) for p in path) + "]")
        out.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars.items())
        if scalars:
            out.append("")
        for k, v in data.items():
            if isinstance(v, dict):
                table([*path, k], v)

    table([], tables)
    return "\n".join(out)


def check_runtime(dist: str, packages: list[str]) -> list[str]:
    """What is wrong with the installed distribution: a package that must not be there, a script that fails."""
    problems = [f"{p} is installed" for p in packages if importlib.util.find_spec(p) is not None]
    scripts = [ep for ep in importlib.metadata.distribution(dist).entry_points if ep.group == "console_scripts"]
    if not scripts:
        problems.append(f"{dist} has no console script")
    for ep in scripts:
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"console script {ep.name} ({ep.value}): {type(exc).__name__}: {exc}")
    return problems


def main(argv: list[str]) -> int:
    command, *args = argv or ["help"]
    if command == "requirements" and len(args) == 2:
        build, runtime = requirements(tomllib.loads(Path(args[0]).read_text()))
        out = Path(args[1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "build.txt").write_text("".join(f"{r}\n" for r in build))
        (out / "runtime.txt").write_text("".join(f"{r}\n" for r in runtime))
        return 0
    if command == "runtime" and len(args) == 2:
        source = Path(args[0])
        wanted = runtime_project(tomllib.loads(source.read_text()), source.parent)
        text = dumps(wanted)
        if tomllib.loads(text) != wanted:  # what was written reads back as what was meant, or nothing is built
            raise SystemExit("packaging: the runtime pyproject.toml does not read back as written")
        Path(args[1]).write_text(text)
        return 0
    if command == "check-runtime" and len(args) >= 2:
        problems = check_runtime(args[0], args[1:])
        for problem in problems:
            print(f"check-runtime: {problem}", file=sys.stderr)
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
