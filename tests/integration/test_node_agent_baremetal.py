"""The production `gpuaas-node-agent` enrols a deployed baremetal host, as a real process against a real
nats-server in operator mode with TLS: the host root holds exactly what cloud-init writes from the gateway's
user-data (its env file and an allocation-bound host user minted by the gateway's scoped key), and the agent
takes its identity from there alone. Its first announcement waits out a stream that is not there yet, then it
says so again on its schedule until its deadline, and it stays up with no slice task consumer. A missing or
garbled file, or a role that contradicts it, ends it with one `invalid_settings` line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import RawCredentials

from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.enrolment import enrolment_token, token_proof
from gpuaas_common.identity import Authority
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS
from gpuaas_common.identity.tls import TlsFiles, client_tls_options
from gpuaas_common.jetstream import provision
from gpuaas_common.startup import EXIT_CODES
from gpuaas_dev.sim.baremetal import write_cloud_init_files
from gpuaas_dev.stack.processes import bin_path
from gpuaas_dev.testing.servers import NatsServer
from gpuaas_dev.testing.waiting import eventually, service_ready
from gpuaas_maas_gateway.service_layer.cloud_init import render_user_data

NODE = "bm-int-1"
SYSTEM = "sys-int-1"
SECRET = "integration-enrolment-secret"


@pytest.fixture
def server(tmp_path: Path, authority: Authority, tls_files: TlsFiles) -> Iterator[NatsServer]:
    # A server per test: the first test starts with no streams at all.
    srv = NatsServer(tmp_path / "nats", auth=authority, tls=tls_files).start()
    yield srv
    srv.stop()


@pytest.fixture
async def admin(server: NatsServer, tls_files: TlsFiles, authority: Authority) -> AsyncIterator[nats.NATS]:
    creds = authority.issue_user("admin", ROLE_PERMISSIONS["admin"])
    nc = await nats.connect(
        server.url,
        user_credentials=RawCredentials(creds.render()),
        **client_tls_options(tls_files.ca),
        inbox_prefix=f"_INBOX_{creds.name}".encode(),
    )
    yield nc
    await nc.close()


def deployed_root(root: Path, authority: Authority, allocation_id: str, *, ttl_s: float = 600.0) -> str:
    """The host's root after first boot: the gateway's user-data applied by cloud-init. Returns the token."""
    token = enrolment_token(SECRET, allocation_id, SYSTEM)
    creds = authority.issuer().issue_node(NODE, ttl_s=ttl_s, allocation_id=allocation_id)
    user_data = render_user_data("", token, allocation_id, NODE, SYSTEM, creds.render())
    write_cloud_init_files(user_data, root)
    return token


def agent_env(root: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
    return {**env, "PYTHONUNBUFFERED": "1", "GPUAAS_HOST_ROOT": str(root), "GPUAAS_HEALTH_PORT": "0", **settings}


def log_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def events_named(path: Path, name: str) -> list[dict]:
    return [line for line in log_events(path) if line.get("event") == name]


async def test_the_agent_enrols_a_deployed_host_and_repeats_until_its_deadline(
    server: NatsServer, tls_files: TlsFiles, authority: Authority, admin: nats.NATS, tmp_path: Path
) -> None:
    allocation_id = str(uuid.uuid4())
    root = tmp_path / "host"
    token = deployed_root(root, authority, allocation_id)
    ready, log_path = tmp_path / "agent.ready", tmp_path / "agent.log"
    env = agent_env(
        root,
        GPUAAS_NATS_URL=server.url,
        GPUAAS_NATS_CA_FILE=str(tls_files.ca),
        GPUAAS_READY_FILE=str(ready),
        GPUAAS_ENROLMENT_ANNOUNCE_AGAIN_S="0.3,0.6",
        GPUAAS_ENROLMENT_ANNOUNCE_FOR_S="10",
    )
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(bin_path("gpuaas-node-agent"), env=env, stdout=log, stderr=log)
    try:
        await service_ready(ready, proc, log_path)
        # No stream yet (the admin has not provisioned this server): the first announcement is retried.
        await eventually(lambda: events_named(log_path, "baremetal_enrol_failed"), 20, what="a failed first try")
        js = admin.jetstream()
        await provision(js)
        ended = await eventually(
            lambda: events_named(log_path, "baremetal_announcements_ended"), 30, what="the announcement deadline"
        )
        repeats = ended[0]["repeats"]
        assert repeats >= 2, "announced again on its schedule"
        info = await js.stream_info("NODE_REPORTS")
        stored = [await js.get_msg("NODE_REPORTS", seq) for seq in range(1, info.state.last_seq + 1)]
        assert len(stored) == 1 + repeats, "the retried first announcement is stored once, each repeat on its own"
        assert {msg.subject for msg in stored} == {f"gpuaas.node.{NODE}.report.enrolled"}
        envelopes = [json.loads(msg.data) for msg in stored]
        for msg, env in zip(stored, envelopes, strict=True):
            default_validator().validate(msg.subject, env)
            assert msg.headers["Nats-Msg-Id"] == env["event_id"] and env["correlation_id"] == allocation_id
        assert len({env["event_id"] for env in envelopes}) == len(envelopes)
        payload = envelopes[0]["payload"]
        assert payload == {
            **payload,
            "node_id": NODE,
            "kind": "baremetal",
            "allocation_id": allocation_id,
            "maas_system_id": SYSTEM,
            "enrolment_proof": token_proof(token),
        }
        assert all(env["payload"] == payload for env in envelopes)
        assert token not in json.dumps(envelopes) and token not in log_path.read_text()

        # It stays as the tenant's host agent: up, connected, and with no slice task consumer.
        assert proc.returncode is None
        tasks = await js.stream_info("NODE_TASKS")
        assert tasks.state.consumer_count == 0
    finally:
        if proc.returncode is None:
            proc.terminate()
        code = await proc.wait()
    assert code == 0, log_path.read_text()[-3000:]


def fails(root: Path, **settings: str) -> dict:
    done = subprocess.run(
        [bin_path("gpuaas-node-agent")],
        env=agent_env(root, GPUAAS_NATS_URL="nats://127.0.0.1:1", GPUAAS_NATS_INSECURE_DEV="true", **settings),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    out = done.stdout + done.stderr
    assert "Traceback" not in out, out
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert [line["event"] for line in lines] == ["startup_failed"], out
    assert (lines[0]["reason"], done.returncode) == ("invalid_settings", EXIT_CODES["invalid_settings"])
    return lines[0]


def test_a_garbled_or_missing_deploy_file_is_one_line(tmp_path: Path, authority: Authority) -> None:
    root = tmp_path / "host"
    token = deployed_root(root, authority, str(uuid.uuid4()))
    env_file = root / "etc/gpuaas/node-agent.env"
    env_file.write_text(env_file.read_text().replace("GPUAAS_ENROLMENT_TOKEN=", "GPUAAS_ENROLMENT_TOKEN "))
    line = fails(root)
    assert "node-agent.env line 4 is not a GPUAAS_NAME=value line" in line["detail"]
    assert token not in json.dumps(line)

    (root / "etc/gpuaas/node.creds").unlink()
    deployed_root(root, authority, str(uuid.uuid4()))
    (root / "etc/gpuaas/node.creds").unlink()
    assert "GPUAAS_NATS_CREDS=/etc/gpuaas/node.creds, which is not there" in fails(root)["detail"]

    assert "no /etc/gpuaas/node-agent.env" in fails(tmp_path / "empty", GPUAAS_ROLE="baremetal")["detail"]


def test_a_deployed_host_cannot_start_as_a_slice_host(tmp_path: Path, authority: Authority) -> None:
    root = tmp_path / "host"
    deployed_root(root, authority, str(uuid.uuid4()))
    line = fails(root, GPUAAS_ROLE="slice_host", GPUAAS_NODE_ID=NODE)
    assert "cannot enrol as a slice host" in line["detail"] and line["setting"] == "GPUAAS_ROLE"
