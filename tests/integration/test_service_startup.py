"""Services fail legibly and log only JSON: real service entrypoints started as processes.

Each start-up failure class (bad settings, Postgres unreachable or refusing, a failing migration, NATS
unreachable or refusing our credentials, a taken port) ends the process with exactly one `startup_failed`
JSON line naming the reason, the reason's own exit code and no traceback; a running service writes JSON
lines only, and its health server answers unknown paths in the shared error shape.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from gpuaas_common.identity import Authority
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS
from gpuaas_common.identity.tls import make_ca_and_server_cert
from gpuaas_common.startup import EXIT_CODES
from gpuaas_dev.stack.processes import bin_path
from gpuaas_dev.testing.servers import NatsServer, free_port
from gpuaas_dev.testing.waiting import service_ready

SECRET_PASSWORD = "pw-that-must-never-be-logged"


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
    # The allocator and the gateway need an enrolment secret (they have no default); the others ignore it.
    secret = {"GPUAAS_ENROLMENT_SECRET": "startup-test-enrolment-secret"}
    # The module's open server is plaintext; the TLS-only refusal tests set the variable to false.
    insecure = {"GPUAAS_NATS_INSECURE_DEV": "true"}
    return {**env, "PYTHONUNBUFFERED": "1", "GPUAAS_HEALTH_PORT": "0", **secret, **insecure, **settings}


def _json_lines(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n--- whole output ---\n{text}") from None
    return parsed


def _fails(command: str, reason: str, **settings: str) -> dict:
    """Run the entrypoint to its end; return its one `startup_failed` line after checking everything else."""
    done = subprocess.run(
        [bin_path(command)], env=_env(**settings), capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL
    )
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out
    lines = _json_lines(out)
    failed = [line for line in lines if line.get("event") == "startup_failed"]
    assert len(failed) == 1, out
    line = failed[0]
    assert lines[-1] is line, "nothing is logged after the failure"
    assert (line["reason"], line["level"], done.returncode) == (reason, "error", EXIT_CODES[reason]), out
    assert line["exit_code"] == done.returncode and line["detail"]
    assert "exception" not in line  # the traceback field is for unclassified failures only
    assert SECRET_PASSWORD not in out
    return line


def _dsn_with(dsn: str, *, user: str | None = None, password: str | None = None, port: int | None = None) -> str:
    parts = urllib.parse.urlsplit(dsn)
    user = user or parts.username or "postgres"
    netloc = f"{user}:{password or parts.password or ''}@{parts.hostname}:{port or parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture(scope="module")
def open_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    # A server of this module's own: the running service provisions every stream on it.
    server = NatsServer(tmp_path_factory.mktemp("nats-startup")).start()
    yield server
    server.stop()


# --- settings -------------------------------------------------------------------------------------------


def test_a_malformed_setting_names_the_variable_not_its_value() -> None:
    line = _fails(
        "gpuaas-allocator",
        "invalid_settings",
        GPUAAS_HEALTH_PORT="70000",
        GPUAAS_RELAY_BATCH_SIZE="many",
        GPUAAS_DATABASE_URL=f"postgresql://gpuaas:{SECRET_PASSWORD}@127.0.0.1:1/gpuaas",
    )
    assert {e["setting"] for e in line["errors"]} == {"GPUAAS_HEALTH_PORT", "GPUAAS_RELAY_BATCH_SIZE"}
    assert line["service"] == "allocator"


def test_a_list_setting_that_cannot_be_decoded() -> None:
    line = _fails("gpuaas-scheduler", "invalid_settings", GPUAAS_RETRY_DELAYS_S="[0.2,")
    assert [e["setting"] for e in line["errors"]] == ["GPUAAS_RETRY_DELAYS_S"]


def test_a_missing_required_setting_of_the_node_agent(tmp_path: Path) -> None:
    line = _fails("gpuaas-node-agent", "invalid_settings", GPUAAS_HOST_ROOT=str(tmp_path))
    assert line["setting"] == "GPUAAS_NODE_ID"


@pytest.mark.parametrize("command", ["gpuaas-allocator", "gpuaas-maas-gateway", "gpuaas-node-agent"])
def test_a_plaintext_bus_is_refused_unless_named_insecure(command: str, tmp_path: Path) -> None:
    """nats:// (or tls:// without the CA) would let a relay strip TLS: refused before anything is dialled."""
    line = _fails(
        command,
        "invalid_settings",
        GPUAAS_NATS_INSECURE_DEV="false",
        GPUAAS_NATS_URL="nats://127.0.0.1:4222",
        GPUAAS_NODE_ID="n1",
        GPUAAS_HOST_ROOT=str(tmp_path),
    )
    assert [e["setting"] for e in line["errors"]] == ["GPUAAS_NATS_URL"]
    assert "GPUAAS_NATS_INSECURE_DEV" in line["detail"]


def test_a_file_named_by_a_setting_that_is_not_there(fresh_db, open_nats, tmp_path: Path) -> None:
    line = _fails(
        "gpuaas-scheduler",
        "invalid_settings",
        GPUAAS_DATABASE_URL=fresh_db,
        GPUAAS_NATS_URL=open_nats.url,
        GPUAAS_INVENTORY_FILE=str(tmp_path / "no-such-fleet.json"),
    )
    assert line["setting"] == "GPUAAS_INVENTORY_FILE"


# --- Postgres -------------------------------------------------------------------------------------------


def test_postgres_nobody_listens(postgres_server) -> None:
    dsn = _dsn_with(postgres_server.dsn, password=SECRET_PASSWORD, port=free_port())
    line = _fails("gpuaas-allocator", "database_unreachable", GPUAAS_DATABASE_URL=dsn, GPUAAS_STARTUP_TIMEOUT_S="1")
    assert "1s" in line["detail"] and line["database"].endswith(f":{urllib.parse.urlsplit(dsn).port}/postgres")


def test_postgres_refuses_the_role(postgres_server) -> None:
    # A role that does not exist is refused even by a cluster that trusts loopback connections.
    dsn = _dsn_with(postgres_server.dsn, user="no_such_role", password=SECRET_PASSWORD)
    line = _fails("gpuaas-allocator", "database_auth_refused", GPUAAS_DATABASE_URL=dsn)
    assert "no_such_role" in line["detail"] and SECRET_PASSWORD not in line["database"]


async def test_a_failing_migration_names_itself_and_commits_nothing_of_it(fresh_db) -> None:
    # Someone made the allocator's outbox by hand, unlike the migration would: the first migration fails.
    conn = await asyncpg.connect(fresh_db)
    try:
        await conn.execute("CREATE SCHEMA allocator; CREATE TABLE allocator.outbox (id int)")
        line = _fails("gpuaas-allocator", "migration_failed", GPUAAS_DATABASE_URL=fresh_db)
        assert (line["schema"], line["migration"]) == ("allocator", "000_outbox_inbox")
        assert "DuplicateTableError" in line["detail"]
        assert await conn.fetchval("SELECT count(*) FROM allocator.schema_migrations") == 0
        assert await conn.fetchval("SELECT to_regclass('allocator.inbox')") is None
    finally:
        await conn.close()


# --- NATS -----------------------------------------------------------------------------------------------


def test_nats_nobody_listens(fresh_db) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    line = _fails(
        "gpuaas-allocator",
        "nats_unreachable",
        GPUAAS_DATABASE_URL=fresh_db,
        GPUAAS_NATS_URL=url,
        GPUAAS_STARTUP_TIMEOUT_S="2",
    )
    assert line["nats_url"] == url


def test_nats_refuses_our_credentials(fresh_db, tmp_path: Path) -> None:
    authority = Authority.create()
    tls = make_ca_and_server_cert(tmp_path / "tls")
    server = NatsServer(tmp_path / "nats", auth=authority, tls=tls).start()
    try:
        expired = authority.issue_user("allocator", ROLE_PERMISSIONS["portal"], ttl_s=-60)
        creds = tmp_path / "allocator.creds"
        creds.write_text(expired.render())
        creds.chmod(0o600)
        line = _fails(
            "gpuaas-allocator",
            "nats_auth_refused",
            GPUAAS_DATABASE_URL=fresh_db,
            GPUAAS_NATS_URL=server.url,
            GPUAAS_NATS_CREDS=str(creds),
            GPUAAS_NATS_CA_FILE=str(tls.ca),
            GPUAAS_STARTUP_TIMEOUT_S="3",
        )
    finally:
        server.stop()
    assert "authorization" in line["detail"].lower() and line["identity"] == "allocator"
    assert expired.seed.decode() not in json.dumps(line) and expired.jwt not in json.dumps(line)


# --- ports ----------------------------------------------------------------------------------------------


def test_the_health_port_is_taken() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        line = _fails("gpuaas-allocator", "port_unavailable", GPUAAS_HEALTH_PORT=str(taken.getsockname()[1]))
    assert line["setting"] == "GPUAAS_HEALTH_PORT"


# --- a running service ----------------------------------------------------------------------------------


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
async def test_a_running_service_logs_json_only(fresh_db, open_nats, tmp_path: Path, event_loop: str) -> None:
    """On either event loop (GPUAAS_EVENT_LOOP): it starts, serves, stops on SIGTERM with 0, logs JSON only."""
    ready = tmp_path / "ready.json"
    log_path = tmp_path / "scheduler.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            bin_path("gpuaas-scheduler"),
            env=_env(
                GPUAAS_DATABASE_URL=fresh_db,
                GPUAAS_NATS_URL=open_nats.url,
                GPUAAS_READY_FILE=str(ready),
                GPUAAS_EVENT_LOOP=event_loop,
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            await service_ready(ready, proc, log_path)
            health = f"http://127.0.0.1:{json.loads(ready.read_text())['health_port']}"
            status, body = _get(f"{health}/nowhere")
            assert (status, body["error"]["code"]) == (404, "not_found") and body["error"]["request_id"]
            assert set(body["error"]) == {"code", "message", "details", "request_id"}
        finally:
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0
    lines = _json_lines(log_path.read_text())
    starts = {line["consumer"] for line in lines if line["event"] == "consumer_started" and line["level"] == "info"}
    assert "scheduler-allocation-events" in starts, lines
    assert {"service_ready", "service_stopped"} <= {line["event"] for line in lines}
    [ready_line] = [line for line in lines if line["event"] == "service_ready"]
    assert ready_line["event_loop"].split(".")[0] == event_loop
    assert all(line["service"] == "scheduler" and line["timestamp"] for line in lines)
