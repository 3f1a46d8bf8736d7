"""`gpuaas dev logs`: the JSON lines rendered for a person (ids first, markup inert), merged in time order across
processes, passed through with --json, and followed as files grow; and `dev up`'s line per part as it becomes
ready."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpuaas_dev.cli import app
from gpuaas_dev.cli.logs import Follower, follow, history, render_line
from gpuaas_dev.cli.progress import StartProgress


def record(event: str, at: str, **kw: Any) -> str:
    return json.dumps({**kw, "event": event, "service": "allocator", "level": "info", "timestamp": at}) + "\n"


def test_a_line_reads_time_level_process_event_then_the_ids_then_the_rest() -> None:
    line = json.dumps({
        "reason": "two words", "operation_id": "op-1", "event": "task_sent", "task_id": "t-9",
        "service": "allocator", "level": "warning", "allocation_id": "a-1", "timestamp": "2030-01-02T03:04:05.678901Z",
        "attempt": 2,
    })  # fmt: skip
    text = render_line("allocator-2", line, colour=False)
    assert text.split() == [
        "03:04:05.678", "warning", "allocator-2", "task_sent",
        "allocation_id=a-1", "task_id=t-9", "operation_id=op-1", 'reason="two', 'words"', "attempt=2",
    ]  # fmt: skip


def test_what_is_not_a_log_record_passes_with_its_process_and_an_exception_follows_indented() -> None:
    assert render_line("scheduler", "--- gpuaas dev: starting scheduler ---\n", colour=False) == (
        "scheduler | --- gpuaas dev: starting scheduler ---"
    )
    boom = json.dumps({"event": "handler_failed", "level": "error", "timestamp": "2030-01-02T03:04:05.678Z",
                       "exception": "Traceback (most recent call last):\nValueError: x"})  # fmt: skip
    first, *rest = render_line("scheduler", boom, colour=False).split("\n")
    assert first.split()[-1] == "handler_failed"
    assert rest == ["    Traceback (most recent call last):", "    ValueError: x"]


def test_markup_in_a_logged_value_is_printed_not_obeyed() -> None:
    from rich.text import Text

    line = record("odd", "2030-01-02T03:04:05.678Z", name="[red]x[/red]", allocation_id="[bold]a")
    plain = Text.from_markup(render_line("allocator", line, colour=True)).plain
    assert 'name="[red]x[/red]"' in plain and 'allocation_id="[bold]a"' in plain


@pytest.fixture
def stack_logs(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "allocator.log").write_text(
        "--- gpuaas dev: starting allocator ---\n"
        + record("a1", "2030-01-01T00:00:01.000Z")
        + record("a3", "2030-01-01T00:00:03.000Z")
    )
    (logs / "scheduler.log").write_text(record("s2", "2030-01-01T00:00:02.000Z") + '{"event": "half a li')
    (logs / "scheduler-2.log").write_text(record("r4", "2030-01-01T00:00:04.000Z"))
    return tmp_path


def gpuaas(run_dir: Path, *argv: str) -> Any:
    return CliRunner().invoke(app, ["dev", "logs", "--run-dir", str(run_dir), *argv])


def test_the_logs_of_every_process_merge_in_time_order(stack_logs: Path) -> None:
    res = gpuaas(stack_logs)
    assert res.exit_code == 0, res.output
    events = [line.split()[3] if "|" not in line else "banner" for line in res.stdout.splitlines()]
    # The banner has no time: it stays before its file's first record; the half-written line is not shown yet.
    assert events == ["banner", "a1", "s2", "a3", "r4"]


def test_a_service_takes_its_replicas_and_json_passes_lines_through(stack_logs: Path) -> None:
    res = gpuaas(stack_logs, "scheduler", "--json")
    assert res.exit_code == 0, res.output
    assert res.stdout == record("s2", "2030-01-01T00:00:02.000Z") + record("r4", "2030-01-01T00:00:04.000Z")
    last = gpuaas(stack_logs, "allocator", "--tail", "1", "--json")
    assert last.stdout == record("a3", "2030-01-01T00:00:03.000Z")


def test_an_unknown_process_or_no_logs_is_one_line_with_the_tables_code(stack_logs: Path, tmp_path: Path) -> None:
    unknown = gpuaas(stack_logs, "nope")
    assert unknown.exit_code == 2 and unknown.stdout == ""
    assert unknown.stderr.strip() == (
        f"no log of 'nope' in {stack_logs / 'logs'}; there are: allocator, scheduler, scheduler-2"
    )
    missing = gpuaas(tmp_path / "elsewhere")
    assert missing.exit_code == 3 and len(missing.stderr.strip().splitlines()) == 1
    assert missing.stderr.startswith(f"no logs: no stack runs in {tmp_path / 'elsewhere'}")


def test_following_hands_on_whole_lines_once_from_where_the_history_stopped(stack_logs: Path) -> None:
    files = {p.stem: p for p in (stack_logs / "logs").glob("*.log")}
    shown, ends = history(files, -1)
    follower = Follower(files, dict(ends))
    assert follower.read() == []
    with (files["scheduler"]).open("a") as f:
        f.write('ne"}\n')
    assert follower.read() == [("scheduler", '{"event": "half a line"}')]
    with (files["allocator"]).open("a") as f:
        f.write(record("a5", "2030-01-01T00:00:05.000Z")[:10])
    assert follower.read() == [], "a line still being written waits for its newline"
    with (files["allocator"]).open("a") as f:
        f.write(record("a5", "2030-01-01T00:00:05.000Z")[10:])
    assert [json.loads(line)["event"] for _, line in follower.read()] == ["a5"]
    # A restarted stack starts its files afresh (shorter, or a new file): read again from the top.
    files["scheduler-2"].write_text(record("n", "2030-01-01T00:00:06.000Z"))
    assert [json.loads(line)["event"] for _, line in follower.read()] == ["n"]
    fresh = files["scheduler-2"].with_suffix(".new")
    fresh.write_text(record("new file", "2030-01-01T00:00:07.000Z") * 2)
    fresh.replace(files["scheduler-2"])
    assert [json.loads(line)["event"] for _, line in follower.read()] == ["new file"] * 2


def test_follow_prints_lines_as_a_file_grows_until_stopped(stack_logs: Path) -> None:
    path = stack_logs / "logs" / "allocator.log"
    files = {"allocator": path}
    _, ends = history(files, 0)
    got: list[str] = []
    changed = threading.Condition()

    def emit(process: str, line: str) -> None:
        with changed:
            got.append(render_line(process, line, colour=False))
            changed.notify_all()

    stop = threading.Event()
    runner = threading.Thread(target=follow, args=(Follower(files, dict(ends)), emit, stop, 0.01))
    runner.start()
    try:
        for n in range(3):
            with path.open("a") as f:
                f.write(record(f"grew{n}", f"2030-01-01T00:01:0{n}.000Z", allocation_id=f"a-{n}"))
            with changed:
                assert changed.wait_for(lambda n=n: len(got) == n + 1, timeout=10), got
        assert [line.split()[3:5] for line in got] == [[f"grew{n}", f"allocation_id=a-{n}"] for n in range(3)]
    finally:
        stop.set()
        runner.join(timeout=10)
    assert not runner.is_alive()


def test_dev_up_says_each_part_once_as_it_becomes_ready(tmp_path: Path) -> None:
    now = [0.0]
    progress = StartProgress(tmp_path, 4242, clock=lambda: now[0])
    (tmp_path / "ready").mkdir()
    stack = {"supervisor_pid": 1, "status": "ready", "nats_url": "tls://old"}
    (tmp_path / "stack.json").write_text(json.dumps(stack))
    assert progress.poll() == [], "an earlier stack's stack.json is not this one's progress"

    def state(**kw: Any) -> None:
        stack.update(supervisor_pid=4242, **kw)
        (tmp_path / "stack.json").write_text(json.dumps(stack))

    state(status="starting", nats_url="tls://127.0.0.1:4222", database_url=None, services={})
    now[0] = 1.5
    assert [line.split() for line in progress.poll()] == [["1.5s", "nats", "ready", "tls://127.0.0.1:4222"]]
    state(database_url="postgresql://gpuaas@127.0.0.1:5432/gpuaas",
          services={"maas-sim": {"pid": 11}, "allocator": {"pid": 12}, "scheduler": {"pid": 13}})  # fmt: skip
    (tmp_path / "ready" / "allocator.json").write_text(json.dumps({"pid": 12, "health_port": 1}))
    (tmp_path / "ready" / "scheduler.json").write_text(json.dumps({"pid": 99, "health_port": 2}))  # a stale file
    now[0] = 4.0
    assert [line.split()[1] for line in progress.poll()] == ["postgres", "allocator"]
    assert progress.poll() == []
    (tmp_path / "ready" / "scheduler.json").write_text(json.dumps({"pid": 13, "health_port": 2}))
    (tmp_path / "ready" / "maas-sim.json").write_text(json.dumps({"pid": 11, "port": 3}))
    state(status="ready")
    assert [line.split()[1] for line in progress.poll()] == ["maas-sim", "scheduler", "stack"]
    assert progress.done and progress.poll() == []
