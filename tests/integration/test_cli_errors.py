"""Every `gpuaas` command that talks to something, run with each class of bad input that applies to it (an id that
is not a UUID, an unknown id, no stack, a refused token, no answer in time): each class ends with its one exit
code and its one wording, on one line of stderr, with nothing on stdout. The parser's own usage errors too (an unknown
option or command, a missing argument, a value it refuses), for every command: exit 2 and one line naming the
command, never typer's boxed usage block.

The admin commands talk to stand-ins of the scheduler admin API that answer in its error shape (404, 401) or
never answer; the bus commands to the session's nats-server, with a stand-in allocator that says "not found" or
stays silent."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import nats
import pytest
from typer.testing import CliRunner

from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_dev.cli import app

BAD = "not-a-uuid"
ALLOC = str(uuid.uuid4())

# argv of every admin command, with NAME where it names a node or slot (kind in the second item).
ADMIN = [
    (["nodes", "list"], None),
    (["nodes", "show", "NAME"], "node"),
    (["nodes", "drain", "NAME", "--reason", "r"], "node"),
    (["nodes", "undrain", "NAME", "--reason", "r"], "node"),
    (["nodes", "mode", "NAME"], "node"),
    (["nodes", "mode", "NAME", "drained", "--reason", "r"], "node"),
    (["nodes", "rediscover", "NAME", "--reason", "r"], "node"),
    (["nodes", "parity", "NAME", "--reason", "r"], "node"),
    (["nodes", "commission", "NAME", "--reason", "r"], "node"),
    (["slots", "list"], None),
    (["slots", "show", "NAME"], "slot"),
    (["slots", "approve", "NAME"], "node"),
    (["slots", "repair", "NAME", "--reason", "r"], "slot"),
    (["slots", "disable", "NAME", "--reason", "r"], "slot"),
    (["quota", "get", "t1"], None),
    (["quota", "set", "t1", "4", "--reason", "r"], None),
    (["wipe-policy", "get"], None),
    (["wipe-policy", "set", "nvme_format", "--reason", "r"], None),
    (["allocations", "force-release", ALLOC, "--reason", "r"], None),
]
# The image pipeline's admin API: (argv, whether it changes something).
IMAGES = [
    (["images", "list"], False),
    (["images", "status", "NAME"], False),
    (["images", "build", "--slug", "NAME"], True),
    (["images", "host-upload", "NAME", "--mode", "upload-only"], True),
]
BUS = [
    ["allocate", "--shape", "gpu_slice"],
    ["release", ALLOC],
    ["allocations", "list"],
    ["allocations", "show", ALLOC],
    ["allocations", "wait", ALLOC],
    ["events", "tail"],
    ["dlq", "list"],
    ["dlq", "show", "1"],
]
ID_TAKERS = [
    ["release", BAD],
    ["allocations", "show", BAD],
    ["allocations", "wait", BAD],
    ["allocations", "force-release", BAD, "--reason", "r"],
    ["allocate", "--shape", "gpu_slice", "--allocation-id", BAD],
]


def _argv(argv: list[str], name: str = "nope") -> list[str]:
    return [name if a == "NAME" else a for a in argv]


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No stack anywhere: no context, no run dir, no URL or token in the environment."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    for var in (
        "GPUAAS_CONTEXT",
        "GPUAAS_RUN_DIR",
        "GPUAAS_NATS_URL",
        "GPUAAS_NATS_CREDS",
        "GPUAAS_NATS_CA_FILE",
        "GPUAAS_SCHEDULER_ADMIN_URL",
        "GPUAAS_SCHEDULER_ADMIN_TOKEN",
        "GPUAAS_IMAGE_ADMIN_URL",
        "GPUAAS_IMAGE_ADMIN_TOKEN",
        "GPUAAS_ADMIN_TOKEN",
    ):
        monkeypatch.delenv(var, raising=False)


def gpuaas(*argv: str) -> Any:
    return CliRunner().invoke(app, list(argv))


def one_line(res: Any) -> str:
    assert res.stdout == "", res.stdout
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


# --- a stand-in admin API ----------------------------------------------------------------------------------------


class _Api(BaseHTTPRequestHandler):
    status = 404
    seen: list[dict[str, Any]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body})
        if self.status == 200:
            payload: dict[str, Any] = {"tenant_id": "t1", "quota": {"tenant_id": "t1", "max_gpus": 4}, "gpus_in_use": 0}
            payload["images"] = []
        else:
            code = {404: "not_found", 401: "unauthorized"}[self.status]
            payload = {"error": {"code": code, "message": "m", "details": {}, "request_id": "r"}}
        data = json.dumps(payload).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: Any) -> None:
        pass


def _serve(status: int) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    handler = type(f"Api{status}", (_Api,), {"status": status, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def api_404() -> Iterator[tuple[str, list]]:
    yield from _serve(404)


@pytest.fixture(scope="module")
def api_401() -> Iterator[tuple[str, list]]:
    yield from _serve(401)


@pytest.fixture(scope="module")
def api_200() -> Iterator[tuple[str, list]]:
    yield from _serve(200)


@pytest.fixture(scope="module")
def api_silent() -> Iterator[str]:
    """Takes connections into its backlog and never reads them: a request gets no answer."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


# --- the classes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", ID_TAKERS, ids=lambda a: " ".join(a[:2]))
def test_an_id_that_is_not_a_uuid_is_a_usage_error_worded_once(argv: list[str]) -> None:
    res = gpuaas(*argv)
    assert res.exit_code == 2
    assert one_line(res) == f"invalid allocation id {BAD!r}: not a UUID"


@pytest.mark.parametrize("argv", BUS, ids=" ".join)
def test_a_bus_command_without_a_stack_says_so(argv: list[str], tmp_path: Path) -> None:
    res = gpuaas(*argv)
    assert res.exit_code == 3
    line = one_line(res)
    assert line.startswith(f"no NATS URL: no stack runs in {tmp_path / '.run' / 'dev'}; "), line
    assert "gpuaas dev up --detach" in line


@pytest.mark.parametrize("argv", [a for a, _ in ADMIN], ids=" ".join)
def test_an_admin_command_without_a_stack_says_so(argv: list[str], tmp_path: Path) -> None:
    res = gpuaas(*_argv(argv))
    assert res.exit_code == 3
    line = one_line(res)
    assert line.startswith(f"no scheduler admin API: no stack runs in {tmp_path / '.run' / 'dev'}; "), line


@pytest.mark.parametrize("argv, kind", [(a, k) for a, k in ADMIN if k], ids=lambda a: " ".join(a) if a else "")
def test_an_unknown_node_or_slot_is_a_failure_worded_once(argv: list[str], kind: str, api_404) -> None:
    url, _ = api_404
    res = gpuaas(*_argv(argv, "ghost-1"), "--admin-url", url, "--token", "t")
    assert res.exit_code == 1
    assert one_line(res) == f"no {kind} ghost-1"


@pytest.mark.parametrize("argv", [a for a, _ in ADMIN], ids=" ".join)
def test_a_refused_token_is_worded_once_and_exits_3(argv: list[str], api_401) -> None:
    url, _ = api_401
    res = gpuaas(*_argv(argv), "--admin-url", url, "--token", "wrong")
    assert res.exit_code == 3
    assert one_line(res) == "refused by the scheduler admin API: HTTP 401 unauthorized (check the token or credentials)"


@pytest.mark.parametrize("argv", [a for a, _ in ADMIN], ids=" ".join)
def test_an_admin_api_that_does_not_answer_times_out_with_4(argv: list[str], api_silent: str) -> None:
    res = gpuaas(*_argv(argv), "--admin-url", api_silent, "--token", "t", "--timeout", "0.3")
    assert res.exit_code == 4
    line = one_line(res)
    assert line.startswith("the scheduler admin API did not answer within 0.3s"), line
    read = argv[1] in ("list", "show", "get") or argv[:3] == ["nodes", "mode", "NAME"] and len(argv) == 3
    # A change that may or may not have been made says how to retry it safely.
    assert ("retry with --idempotency-key" in line) is not read


def test_a_change_carries_the_token_a_fresh_idempotency_key_and_the_actor(api_200) -> None:
    url, seen = api_200
    seen.clear()
    for _ in range(2):
        res = gpuaas("quota", "set", "t1", "4", "--reason", "more", "--admin-url", url, "--token", "tok", "-o", "json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["quota"]["max_gpus"] == 4
    again = gpuaas("quota", "set", "t1", "4", "--reason", "more", "--admin-url", url, "--token", "tok",
                   "--idempotency-key", "k-1", "--actor", "ops.alice")  # fmt: skip
    assert again.exit_code == 0, again.output
    assert [s["path"] for s in seen] == ["/v1/tenants/t1/quota"] * 3
    assert {s["headers"]["Authorization"] for s in seen} == {"Bearer tok"}
    keys = [s["headers"]["Idempotency-Key"] for s in seen]
    assert len(set(keys[:2])) == 2 and keys[2] == "k-1"
    assert seen[2]["body"] == {"actor": "ops.alice", "reason": "more", "max_gpus": 4}
    assert seen[0]["body"]["actor"], "the login name when --actor is not given"


# --- the bus classes ---------------------------------------------------------------------------------------------


@pytest.fixture
async def allocator_stub(nats_server) -> AsyncIterator[dict[str, str]]:
    """Answers allocation.query with not_found, or not at all while `mode["answer"]` is "silent"."""
    mode = {"answer": "not_found"}
    nc = await nats.connect(nats_server.url)

    async def on_query(msg: Any) -> None:
        if mode["answer"] == "silent":
            return
        query = Envelope.model_validate(json.loads(msg.data))
        result = m.AllocationQueryResult(status="not_found")
        answer = Envelope.wrap(
            "allocation.query_result",
            result.model_dump(mode="json"),
            producer="allocator",
            correlation_id=query.correlation_id,
        )
        await msg.respond(answer.model_dump_json().encode())

    await nc.subscribe(spec_for("allocation.query").subject(), cb=on_query)
    await nc.flush()
    mode["url"] = nats_server.url
    yield mode
    await nc.drain()


async def test_an_unknown_allocation_is_a_failure_worded_once(allocator_stub) -> None:
    for argv in (["allocations", "show", ALLOC], ["allocations", "wait", ALLOC]):
        res = await asyncio.to_thread(gpuaas, *argv, "--nats-url", allocator_stub["url"])
        assert res.exit_code == 1, res.output
        assert one_line(res) == f"no allocation {ALLOC}"


async def test_an_allocator_that_does_not_answer_times_out_with_4(allocator_stub) -> None:
    allocator_stub["answer"] = "silent"
    for argv in (["allocations", "list"], ["allocations", "show", ALLOC], ["allocations", "wait", ALLOC]):
        res = await asyncio.to_thread(gpuaas, *argv, "--nats-url", allocator_stub["url"], "--timeout", "0.3")
        assert res.exit_code == 4, res.output
        assert one_line(res) == "the allocator did not answer within 0.3s"


# --- the image pipeline's admin API ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [a for a, _ in IMAGES], ids=" ".join)
def test_an_images_command_without_a_stack_says_so(argv: list[str], tmp_path: Path) -> None:
    res = gpuaas(*_argv(argv))
    assert res.exit_code == 3
    line = one_line(res)
    assert line.startswith(f"no image admin API: no stack runs in {tmp_path / '.run' / 'dev'}; "), line
    assert "$GPUAAS_IMAGE_ADMIN_TOKEN" in line


@pytest.mark.parametrize("argv", [a for a, _ in IMAGES if "NAME" in a], ids=" ".join)
def test_an_unknown_image_is_a_failure_worded_once(argv: list[str], api_404) -> None:
    url, _ = api_404
    res = gpuaas(*_argv(argv, "ghost-1"), "--admin-url", url, "--token", "t")
    assert res.exit_code == 1
    assert one_line(res) == "no image ghost-1"


@pytest.mark.parametrize("argv", [a for a, _ in IMAGES], ids=" ".join)
def test_a_refused_image_token_is_worded_once_and_exits_3(argv: list[str], api_401) -> None:
    url, _ = api_401
    res = gpuaas(*_argv(argv), "--admin-url", url, "--token", "wrong")
    assert res.exit_code == 3
    assert one_line(res) == (
        "refused by the image pipeline admin API: HTTP 401 unauthorized (check the token or credentials)"
    )


@pytest.mark.parametrize("argv, changes", IMAGES, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_an_image_api_that_does_not_answer_times_out_with_4(argv: list[str], changes: bool, api_silent: str) -> None:
    res = gpuaas(*_argv(argv), "--admin-url", api_silent, "--token", "t", "--timeout", "0.3")
    assert res.exit_code == 4
    line = one_line(res)
    assert line.startswith("the image pipeline admin API did not answer within 0.3s"), line
    assert ("retry with --idempotency-key" in line) is changes


def test_the_image_token_comes_from_its_own_variable_then_the_services_then_the_stack(
    api_200, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compose's .env names it GPUAAS_IMAGE_ADMIN_TOKEN; GPUAAS_ADMIN_TOKEN is what the service itself reads."""
    url, seen = api_200
    run_dir = tmp_path / "stack"
    run_dir.mkdir()
    (run_dir / "secrets.json").write_text(json.dumps({"image_admin_token": "from-secrets"}))
    stack = {"status": "ready", "supervisor_pid": os.getpid(), "image_admin_url": url,
             "secrets_file": str(run_dir / "secrets.json")}  # fmt: skip
    (run_dir / "stack.json").write_text(json.dumps(stack))
    monkeypatch.setenv("GPUAAS_RUN_DIR", str(run_dir))
    monkeypatch.setenv("GPUAAS_IMAGE_ADMIN_TOKEN", "from-image-var")
    monkeypatch.setenv("GPUAAS_ADMIN_TOKEN", "from-admin-var")
    used = []
    for unset in (None, "GPUAAS_IMAGE_ADMIN_TOKEN", "GPUAAS_ADMIN_TOKEN"):
        if unset:
            monkeypatch.delenv(unset)
        seen.clear()
        res = gpuaas("images", "list", "-o", "json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["images"] == []
        used.append(seen[0]["headers"]["Authorization"])
    assert used == ["Bearer from-image-var", "Bearer from-admin-var", "Bearer from-secrets"]
    monkeypatch.setenv("GPUAAS_IMAGE_ADMIN_TOKEN", "")  # compose-env.sh leaves a blank when none was made
    seen.clear()
    assert gpuaas("images", "list").exit_code == 0
    assert seen[0]["headers"]["Authorization"] == "Bearer from-secrets"


# --- identities ---------------------------------------------------------------------------------------------------


def _keys(tmp_path: Path) -> Path:
    res = gpuaas("identities", "init", "--out", str(tmp_path / "trust"))
    assert res.exit_code == 0, res.output
    return tmp_path / "trust" / "keys"


def test_identities_without_keys_is_a_usage_error_worded_once(tmp_path: Path) -> None:
    missing = tmp_path / "no-keys"
    for argv in (
        ["identities", "onboard-host", "slice-01", "--out", str(tmp_path / "h.creds"), "--keys-dir", str(missing)],
        ["identities", "decommission-host", "slice-01", "--nats-url", "nats://127.0.0.1:1", "--keys-dir", str(missing)],
    ):
        res = gpuaas(*argv)
        assert res.exit_code == 2, res.output
        assert one_line(res).startswith(f"cannot read keys in {missing}: "), res.stderr
    assert not (tmp_path / "h.creds").exists()


def test_decommissioning_a_host_never_onboarded_is_a_failure_worded_once(tmp_path: Path) -> None:
    keys = _keys(tmp_path)
    res = gpuaas(
        "identities", "decommission-host", "ghost-1", "--nats-url", "nats://127.0.0.1:1", "--keys-dir", str(keys)
    )
    assert res.exit_code == 1
    assert one_line(res) == f"no host ghost-1: no user was issued to it from {keys}"


def test_identities_against_no_bus_exit_3_and_write_nothing(tmp_path: Path) -> None:
    keys = _keys(tmp_path)
    before = (keys / "issued-hosts.json").read_bytes() if (keys / "issued-hosts.json").exists() else None
    port = _closed_port()
    out = tmp_path / "slice-01.creds"
    onboard = gpuaas("identities", "onboard-host", "slice-01", "--out", str(out), "--keys-dir", str(keys),
                     "--nats-url", f"nats://127.0.0.1:{port}")  # fmt: skip
    assert onboard.exit_code == 3, onboard.output
    assert one_line(onboard).startswith(f"cannot connect to NATS at nats://127.0.0.1:{port}"), onboard.stderr
    assert not out.exists(), "no creds for a host whose durable could not be made"
    after = (keys / "issued-hosts.json").read_bytes() if (keys / "issued-hosts.json").exists() else None
    assert after == before
    admin = tmp_path / "trust" / "creds" / "admin.creds"
    provision = gpuaas("identities", "provision", "--nats-url", f"nats://127.0.0.1:{port}", "--creds", str(admin))
    assert provision.exit_code == 3, provision.output
    assert one_line(provision).startswith(f"cannot connect to NATS at nats://127.0.0.1:{port}")


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# --- the parser's own usage errors -------------------------------------------------------------------------------


def _leaves() -> list[tuple[list[str], Any]]:
    from gpuaas_dev.docs import cli_commands

    return [(path[1:], cmd) for path, cmd, _ in cli_commands()]


LEAVES = _leaves()


def _usage_line(res: Any, path: list[str]) -> str:
    """The line of a usage error: exit 2, no box and no usage block, the command named, where its help is."""
    assert res.exit_code == 2, res.output
    line = one_line(res)
    command = " ".join(["gpuaas", *path])
    assert line.startswith(f"{command}: ") and line.endswith(f"(`{command} -h` for help)"), line
    return line[len(command) + 2 : -len(f" (`{command} -h` for help)")]


@pytest.mark.parametrize("path", [p for p, _ in LEAVES], ids=" ".join)
def test_an_unknown_option_is_a_usage_error_worded_once(path: list[str]) -> None:
    assert _usage_line(gpuaas(*path, "--no-such-option"), path) == "no such option: --no-such-option"


@pytest.mark.parametrize("path", [p for p, cmd in LEAVES if any(param.required for param in cmd.params)], ids=" ".join)
def test_a_missing_argument_or_option_is_a_usage_error_worded_once(path: list[str]) -> None:
    assert _usage_line(gpuaas(*path), path).startswith("missing ")


@pytest.mark.parametrize(
    "path",
    [p for p, cmd in LEAVES if any("--output" in getattr(param, "opts", ()) for param in cmd.params)],
    ids=" ".join,
)
def test_an_output_format_it_does_not_know_is_a_usage_error_worded_once(path: list[str]) -> None:
    said = _usage_line(gpuaas(*path, "-o", "xml"), path)
    # A required argument not given may be said first; either way one line, exit 2.
    assert said.startswith("missing ") or said.startswith("invalid value for '--output' / '-o': 'xml' is not one of")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["bogus"], "no such command 'bogus'"),
        (["nodes", "bogus"], "no such command 'bogus'"),
        (["--bogus"], "no such option: --bogus"),
        (["release", ALLOC, "extra"], "got unexpected extra argument"),
        (["allocate", "--shape", "gpu_slice", "--gpus", "two"], "invalid value for '--gpus'"),
        (["dev", "up", "--slots", "9"], "invalid value for '--slots'"),
        (["dlq", "list", "--limit", "0"], "invalid value for '--limit'"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_bad_words_of_every_kind_are_one_line_usage_errors(argv: list[str], said: str) -> None:
    path = [a for a in argv[:2] if a in ("nodes", "release", "allocate", "dev", "up", "dlq", "list")]
    assert _usage_line(gpuaas(*argv), path).startswith(said)
