"""Which stack a `gpuaas` command talks to: `dev up` records a context and makes it current, so commands find the
stack from any directory; `--run-dir`, `--context`, $GPUAAS_CONTEXT and $GPUAAS_RUN_DIR choose another, in that
order; `gpuaas context show` says which and why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from gpuaas_dev.cli import OWN_RUN_DIR, app
from gpuaas_dev.cli.context import contexts_file, load, record, run_dir_defaults


@pytest.fixture(autouse=True)
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for var in ("GPUAAS_CONTEXT", "GPUAAS_RUN_DIR"):
        monkeypatch.delenv(var, raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return tmp_path / "config"


def gpuaas(*argv: str) -> Any:
    return CliRunner().invoke(app, list(argv))


def status_run_dir(*argv: str) -> str:
    """The run dir `dev status` looked in (it answers 3, the table's "nothing to talk to": no stack there)."""
    res = gpuaas(*argv)
    assert res.exit_code == 3, res.output
    return json.loads(res.stdout)["run_dir"]


def test_the_recorded_stack_is_found_from_any_directory(tmp_path: Path, config: Path) -> None:
    stack = tmp_path / "checkout" / ".run" / "mine"
    assert record(stack) == "mine"
    assert contexts_file() == config / "gpuaas" / "contexts.json"
    shown = gpuaas("context", "show", "-o", "json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout) == {
        "name": "mine",
        "source": "current context",
        "run_dir": str(stack),
        "status": "absent",
        "nats_url": None,
        "scheduler_admin_url": None,
        "image_admin_url": None,
        "ops_admin_url": None,
    }
    assert status_run_dir("dev", "status", "--json") == str(stack)


def test_run_dir_then_context_then_environment_then_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    current, other, env_dir, given = (tmp_path / n for n in ("current", "other", "env", "given"))
    record(other)
    record(current)
    monkeypatch.setenv("GPUAAS_RUN_DIR", str(env_dir))
    assert status_run_dir("dev", "status", "--json") == str(env_dir)
    monkeypatch.setenv("GPUAAS_CONTEXT", "other")
    assert status_run_dir("dev", "status", "--json") == str(other)
    assert status_run_dir("--context", "current", "dev", "status", "--json") == str(current)
    assert status_run_dir("--context", "current", "dev", "status", "--json", "--run-dir", str(given)) == str(given)
    shown = json.loads(gpuaas("--context", "current", "context", "show", "-o", "json").stdout)
    assert (shown["name"], shown["source"]) == ("current", "--context")


def test_without_any_context_the_working_directory_default_stays() -> None:
    assert status_run_dir("dev", "status", "--json") == str(Path.cwd() / ".run" / "dev")


def test_an_unknown_context_is_a_usage_error_naming_the_known_ones(tmp_path: Path) -> None:
    record(tmp_path / "a")
    for argv in (["--context", "nope", "nodes", "list"], ["context", "use", "nope"], ["context", "delete", "nope"]):
        res = gpuaas(*argv)
        assert res.exit_code == 2, res.output
        assert res.stderr.strip() == "unknown context 'nope': known contexts: a"


def test_use_list_and_delete(tmp_path: Path) -> None:
    record(tmp_path / "a")
    record(tmp_path / "b")
    assert gpuaas("context", "use", "a").exit_code == 0
    assert load()["current"] == "a"
    rows = json.loads(gpuaas("context", "list", "-o", "json").stdout)["contexts"]
    assert [(r["current"], r["name"]) for r in rows] == [("*", "a"), ("", "b")]
    assert gpuaas("context", "delete", "a").exit_code == 0
    assert load() == {"current": None, "contexts": {"b": {"run_dir": str(tmp_path / "b")}}}


def test_a_second_stack_of_the_same_name_takes_the_name_over(tmp_path: Path) -> None:
    record(tmp_path / "one" / "dev")
    record(tmp_path / "two" / "dev")
    assert load()["contexts"] == {"dev": {"run_dir": str(tmp_path / "two" / "dev")}}


def test_an_unreadable_contexts_file_counts_as_none(config: Path) -> None:
    (config / "gpuaas").mkdir(parents=True)
    contexts_file().write_text("{not json")
    assert load() == {"current": None, "contexts": {}}
    assert gpuaas("context", "list").exit_code == 0


def test_dev_up_and_the_lab_keep_their_own_run_dir(tmp_path: Path) -> None:
    defaults = run_dir_defaults(typer.main.get_command(app), tmp_path, OWN_RUN_DIR)
    assert "up" not in defaults["dev"] and "supervise" not in defaults["dev"] and "lab" not in defaults
    assert defaults["dev"]["status"] == {"run_dir": tmp_path}
    assert defaults["nodes"]["drain"] == {"run_dir": tmp_path}
    assert defaults["images"]["list"] == {"run_dir": tmp_path}, "the images commands find the stack too"
    assert "contract" not in defaults, "no run dir, no default"
