"""Identities on the running stack: a released baremetal host loses its bus identity at once, a host
cannot forge another host's results, and no secret shows up in any log, event or description."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time

import nats
import pytest
import yaml
from nats.aio.client import RawCredentials

from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.tls import client_tls_options

from .conftest import maas_sim

pytestmark = pytest.mark.e2e

SEEN_SECRETS: list[str] = []  # secrets met during the module's tests, checked by the last test


async def _host_connect(stack, creds_text: str, closed: asyncio.Event | None = None):
    async def on_closed() -> None:
        if closed is not None:
            closed.set()

    name = creds_files.parse(creds_text).name
    return await nats.connect(
        stack.nats_url,
        user_credentials=RawCredentials(creds_text),
        **client_tls_options(stack.ca_file),
        inbox_prefix=f"_INBOX_{name}".encode(),
        allow_reconnect=False,
        connect_timeout=5,
        closed_cb=on_closed,
    )


async def test_released_baremetal_host_loses_its_credentials_at_once(portal, stack, db) -> None:
    alloc = await portal.request("baremetal", gpus=8)
    placed = await portal.wait_state(alloc, "placed")
    await portal.wait_state(alloc, "active", timeout=90)
    machine = await maas_sim(stack, "GET", f"/_sim/machines/{placed['payload']['maas_system_id']}")
    user_data = yaml.safe_load(machine["_sim"]["last_deploy"]["user_data"])
    creds_text = next(f["content"] for f in user_data["write_files"] if f["path"] == "/etc/gpuaas/node.creds")
    creds = creds_files.parse(creds_text)
    SEEN_SECRETS.extend([creds.seed.decode(), creds.jwt])
    node_id = placed["payload"]["node_id"]
    assert creds.claims["nats"]["tags"] == [f"node:{node_id}", f"allocation:{alloc}"]
    assert creds.claims["exp"] > creds.claims["iat"], "a baremetal host's user expires on its own"

    closed = asyncio.Event()
    host = await _host_connect(stack, creds_text, closed)
    portal.spy.allow_invalid(b"not json")
    # Its one subject (issue 38: a baremetal tenant's host sends its enrolment and no slice report).
    ack = await host.jetstream().publish(f"gpuaas.node.{node_id}.report.enrolled", b"not json", timeout=5)
    assert ack.stream == "NODE_REPORTS"

    await portal.release(alloc)
    await portal.wait_state(alloc, "released", timeout=90)
    await asyncio.wait_for(closed.wait(), timeout=5)  # closed by the server, no restart involved
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await _host_connect(stack, creds_text)
    revoked = await db.fetchval(
        "SELECT count(*) FROM maas_gateway.maas_host_credentials WHERE allocation_id = $1 AND revoked_at IS NOT NULL",
        str(alloc),
    )
    assert revoked >= 1


async def test_a_host_cannot_forge_results_for_tasks_it_was_never_sent(portal, stack, db) -> None:
    alloc = await portal.request("gpu_slice", gpus=1)
    placed = await portal.wait_state(alloc, "placed")
    await portal.wait_state(alloc, "active")
    victim = placed["payload"]["node_id"]
    attacker = next(n.node_id for n in stack.fleet.nodes if n.kind == "slice_host" and n.node_id != victim)
    text = stack.creds_path(f"node-{attacker}").read_text()
    nc = await _host_connect(stack, text)
    js = nc.jetstream()

    async def forge(node_in_payload: str, task_id: str) -> None:
        result = m.NodeTaskResult(
            task_id=task_id,
            allocation_id=alloc,
            node_id=node_in_payload,
            task_type="slice.vm_release",
            status="succeeded",
        )
        env = Envelope.wrap(
            "node.task_result", result.model_dump(mode="json"), producer="node-agent", correlation_id=str(alloc)
        )
        await js.publish(
            f"gpuaas.node.{attacker}.report.task_result",
            env.model_dump_json().encode(),
            headers={"Nats-Msg-Id": env.event_id},
        )

    await forge(victim, "rel-forged")  # claims to be the victim host
    await forge(attacker, "rel-forged-2")  # as itself, for a task it never got
    task_id = portal.spy.of_type("slice.vm_provision", allocation_id=alloc)[0]["payload"]["task_id"]
    await forge(attacker, task_id)  # the real task id, but the task went to another host

    def letters() -> list[dict]:
        return [
            d["payload"]
            for _, d in portal.spy.messages
            if d.get("type") == "dead_letter"
            # The allocator's letters: ops-view, which follows the same reports, refuses the forgeries too.
            and d["payload"]["consumer"] == "allocator-task-results"
            and d["payload"]["subject"] == f"gpuaas.node.{attacker}.report.task_result"
            and str(alloc) in (d["payload"].get("body_text") or "")
        ]

    await portal.spy.wait_for(lambda: len(letters()) >= 3, 30, "three dead letters")
    assert sorted(p["reason_code"] for p in letters()) == ["node_mismatch", "subject_mismatch", "unknown_task"]
    assert all(p["reason"] for p in letters())
    row = await db.fetchrow("SELECT state, release_task_id FROM allocator.allocations WHERE allocation_id = $1", alloc)
    assert (row["state"], row["release_task_id"]) == ("active", None), "a forged result changed the allocation"
    await nc.close()
    await portal.release(alloc)
    await portal.wait_state(alloc, "released")


async def test_decommissioning_a_slice_host_revokes_its_user_at_once(stack) -> None:
    """What ops run when a host leaves: the agent's connection is closed by the server, no restart."""
    import subprocess
    import sys
    from pathlib import Path

    node = [n.node_id for n in stack.fleet.nodes if n.kind == "slice_host"][-1]
    text = stack.creds_path(f"node-{node}").read_text()
    closed = asyncio.Event()
    nc = await _host_connect(stack, text, closed)
    gpuaas = str(Path(sys.executable).parent / "gpuaas")
    res = await asyncio.to_thread(
        subprocess.run,
        [
            gpuaas,
            "identities",
            "decommission-host",
            node,
            "--nats-url",
            stack.nats_url,
            "--keys-dir",
            str(stack.run_dir / "keys"),
            "--ca-file",
            str(stack.ca_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    await asyncio.wait_for(closed.wait(), timeout=5)
    with pytest.raises(Exception, match="(?i)authorization violation"):
        await _host_connect(stack, text)
    assert not nc.is_connected

    # The fleet process's own link for that host lost its session too. When the server ended it with -ERR the
    # refusal is logged, once per reason and as a warning; a server that just closes the socket leaves nats-py
    # nothing but end-of-stream to report (a known gap). Either way the process keeps serving its other hosts.
    def refusals() -> list[dict]:
        lines = stack.log_path("node-agent").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        return [e for e in events if e.get("event") == "nats_auth_refused" and e.get("identity") == f"node-{node}"]

    reasons = [e["reason"] for e in refusals()]
    assert len(reasons) == len(set(reasons)), f"a refusal was logged more than once: {reasons}"
    assert all(e["level"] == "warning" for e in refusals())
    assert stack.is_running("node-agent")


async def test_every_process_takes_up_renewed_credentials_without_a_restart(portal, stack) -> None:
    """Users live a day (hosts three) and are issued again at half-life: the stack's renewer, judged by a clock
    37 hours on, renews every role and every slice host still in slice mode; each service and each host's link
    switches to its new user while it runs, and a slice allocation still flows end to end."""
    from gpuaas_common.identity.permissions import SERVICES as BUS_SERVICES
    from gpuaas_dev.testing.waiting import eventually

    pids = {name: stack.pid(name) for name in stack.processes}
    slice_hosts = [n.node_id for n in stack.fleet.nodes if n.kind == "slice_host"]
    decommissioned = slice_hosts[-1]  # by the test above: its user is revoked, so it is not renewed
    before = stack.creds_path(f"node-{decommissioned}").read_text()
    renewed = await asyncio.to_thread(stack.renew_credentials, time.time() + 37 * 3600)
    assert set(renewed) == {*BUS_SERVICES, "credential-authority", "portal", "ops", "admin", *slice_hosts[:-1]}
    assert stack.creds_path(f"node-{decommissioned}").read_text() == before

    def switched(process: str) -> set[str]:
        lines = stack.log_path(process).read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        return {e["identity"] for e in events if e.get("event") == "nats_creds_renewed"}

    for service in (*BUS_SERVICES, "credential-authority"):
        await eventually(lambda s=service: s in switched(s), timeout=20, what=f"{service}'s switch")
    hosts = {f"node-{n}" for n in slice_hosts[:-1]}
    await eventually(lambda: hosts <= switched("node-agent"), timeout=20, what="the hosts' switches")
    alloc = await portal.request("gpu_slice", gpus=1)
    await portal.wait_state(alloc, "active")
    await portal.release(alloc)
    await portal.wait_state(alloc, "released")
    assert {name: stack.pid(name) for name in stack.processes} == pids, "no process was restarted"


def _secrets(stack) -> dict[str, str]:
    found: dict[str, str] = {}
    secrets_json = json.loads((stack.run_dir / "secrets.json").read_text())
    found["maas_api_key"] = stack.maas_api_key
    found["enrolment_secret"] = stack.enrolment_secret
    for service in ("scheduler", "image-pipeline"):
        found[f"{service} admin token"] = stack.admin_token(service)
    for name in ("billing_token", "console_token", "console_login_secret"):  # each principal's own
        found[name] = stack.principal_secret(name)
    for name, dsn in secrets_json.get("service_database_urls", {}).items():
        password = re.match(r"^[^:]+://[^:]+:([^@]+)@", dsn)
        if password:
            found[f"db password {name}"] = password.group(1)
    for path in (stack.run_dir / "keys").glob("*.nk"):
        found[f"seed {path.name}"] = path.read_text().strip()
    for path in stack.creds_dir.glob("*.creds"):
        c = creds_files.read(path)
        found[f"seed {path.name}"] = c.seed.decode()
        found[f"jwt {path.name}"] = c.jwt
    for i, secret in enumerate(SEEN_SECRETS):
        found[f"baremetal host secret {i}"] = secret
    return found


def test_secret_files_are_owner_only(stack) -> None:
    for path in [*stack.creds_dir.glob("*.creds"), *(stack.run_dir / "keys").iterdir(), stack.run_dir / "secrets.json"]:
        assert path.stat().st_mode & 0o077 == 0, f"{path.name} is readable by others"


def test_no_secret_in_any_log_event_or_description(portal, stack) -> None:
    """Runs last in the module: every log line and every event of the flows above."""
    secrets = _secrets(stack)
    assert SEEN_SECRETS, "the baremetal test did not run first"
    # Every log of the run, the servers' own included: a seed in a CONNECT the NATS server logged, or a password in
    # a statement Postgres logged, leaks as surely as one a service wrote.
    # Postgres run as root keeps its cluster, log included, in a directory of its own outside the run's.
    roots = [stack.run_dir, *([stack._pg.data_dir] if not stack._pg.data_dir.is_relative_to(stack.run_dir) else [])]
    logs = sorted({p for root in roots for p in root.rglob("*.log")})
    haystacks = {f"log {p}": p.read_text(errors="replace") for p in logs}
    for server_log in ("nats.log", "postgres.log", "registry.log"):
        assert any(p.name == server_log for p in logs), f"no {server_log} scanned"
    haystacks["events"] = "\n".join(json.dumps(data) for _, data in portal.spy.messages)
    haystacks["stack.json"] = (stack.run_dir / "stack.json").read_text()
    assert len(portal.spy.messages) > 20
    # Base64 too: a header or a body logged encoded carries the secret all the same.
    forms = {
        what: (secret, base64.b64encode(secret.encode()).decode().rstrip("="))
        for what, secret in secrets.items()
        if len(secret) >= 12
    }
    leaks = [
        f"{what} in {where}"
        for what, variants in forms.items()
        for where, text in haystacks.items()
        if any(v in text for v in variants)
    ]
    assert leaks == []
