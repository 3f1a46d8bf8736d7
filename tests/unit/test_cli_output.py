"""How `gpuaas` prints and helps: -o formats of one document, AGE, --watch printing changes only, -h everywhere,
completion scripts that complete, help text on every option and an example in every command's help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from gpuaas_dev.cli import app
from gpuaas_dev.cli.output import age, age_of, render, watch
from gpuaas_dev.docs import cli_commands

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    "ago, shown",
    [(timedelta(seconds=5), "5s"), (timedelta(seconds=119), "119s"), (timedelta(minutes=2), "2m"),
     (timedelta(minutes=100), "100m"), (timedelta(hours=3), "3h"), (timedelta(hours=47), "47h"),
     (timedelta(days=9), "9d"), (timedelta(seconds=-3), "0s")],
)  # fmt: skip
def test_age_is_the_largest_whole_unit(ago: timedelta, shown: str) -> None:
    assert age((NOW - ago).isoformat(), now=NOW) == shown


def test_age_of_nothing_is_a_dash() -> None:
    assert age(None) == "-" and age("") == "-"


ROWS = [
    {"node_id": "n1", "draining": True, "tags": ["a", "b"], "updated_at": (NOW - timedelta(minutes=5)).isoformat()},
    {"node_id": "node-two", "draining": False, "tags": [], "updated_at": None},
]
DOC = {"nodes": ROWS}


def test_json_and_yaml_print_the_same_document() -> None:
    as_json = json.loads(render(DOC, "json", rows=ROWS, columns=["node_id"]))
    as_yaml = yaml.safe_load(render(DOC, "yaml", rows=ROWS, columns=["node_id"]))
    assert as_json == as_yaml == DOC
    assert "\n" not in render(DOC, "json", compact=True)


def test_table_and_wide() -> None:
    columns = ["node_id", "draining", age_of("updated_at")]
    lines = render(DOC, "table", rows=ROWS, columns=columns, wide=["tags"]).splitlines()
    assert lines[0].split() == ["NODE-ID", "DRAINING", "AGE"]
    assert lines[1].split()[:2] == ["n1", "yes"] and lines[2].split() == ["node-two", "no", "-"]
    assert lines[1].index("yes") == lines[0].index("DRAINING"), "aligned columns"
    wide = render(DOC, "wide", rows=ROWS, columns=columns, wide=["tags"]).splitlines()
    assert wide[0].split()[-1] == "TAGS" and wide[1].split()[-1] == "a,b" and wide[2].split()[-1] == "-"


def test_watch_prints_each_change_once_and_ends_on_ctrl_c(capsys: pytest.CaptureFixture[str]) -> None:
    answers = iter([{"v": 1}, {"v": 1}, {"v": 2}, {"v": 2}, {"v": 1}])
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 5:
            raise KeyboardInterrupt

    watch(lambda: next(answers), lambda doc, compact: render(doc, "json", compact=compact), 1.5, sleep=sleep)
    assert capsys.readouterr().out.splitlines() == ['{"v":1}', '{"v":2}', '{"v":1}']
    assert naps == [1.5] * 5


def test_a_failed_ask_ends_the_watch_with_its_exit_code() -> None:
    def fetch() -> Any:
        raise typer.Exit(3)

    with pytest.raises(typer.Exit) as ended:
        watch(fetch, lambda doc, compact: "", 1.0, sleep=lambda s: None)
    assert ended.value.exit_code == 3


@pytest.mark.parametrize("argv", [[], ["nodes"], ["allocations", "wait"], ["context", "show"]])
def test_dash_h_is_help(argv: list[str]) -> None:
    res = CliRunner().invoke(app, [*argv, "-h"])
    assert res.exit_code == 0 and "Usage:" in res.stdout


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_the_completion_script_names_the_completion_variable(shell: str) -> None:
    res = CliRunner().invoke(app, ["completion", shell])
    assert res.exit_code == 0 and "_GPUAAS_COMPLETE" in res.stdout


def test_completion_completes_commands_and_choices(tmp_path: Path) -> None:
    gpuaas = str(Path(sys.executable).parent / "gpuaas")

    def complete(words: str) -> str:
        env = {**os.environ, "_GPUAAS_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
               "XDG_CONFIG_HOME": str(tmp_path)}  # fmt: skip
        return subprocess.run([gpuaas], env=env, capture_output=True, text=True, timeout=60).stdout

    assert "nodes" in complete("gpuaas no").split()
    assert set(complete("gpuaas nodes list -o ").split()) == {"table", "wide", "json", "yaml"}


def _ours(cmd: Any) -> bool:
    return getattr(cmd.callback, "__module__", "").startswith("gpuaas_dev.cli.")


def test_every_option_has_help_and_every_command_an_example() -> None:
    missing_help, missing_example = [], []
    for path, cmd, _ in cli_commands():
        if not _ours(cmd):
            continue
        name = " ".join(path)
        for param in cmd.params:
            if not getattr(param, "help", None):
                missing_help.append(f"{name} {param.name}")
        if "Example:" not in (cmd.help or ""):
            missing_example.append(name)
    assert missing_help == [] and missing_example == []


def test_read_commands_take_output_and_watch() -> None:
    reads = {"nodes list", "nodes show", "slots list", "slots show", "allocations list", "allocations show"}
    for path, cmd, _ in cli_commands():
        name = " ".join(path[1:])
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        if name in reads:
            assert {"-o", "--output", "--watch"} <= opts, name
        if name.endswith((" get", " list", " show")) and _ours(cmd):
            assert {"-o", "--output"} <= opts, name
