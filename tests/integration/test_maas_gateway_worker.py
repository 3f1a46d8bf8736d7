"""The gateway's real OperationWorker against the in-process MAAS simulator and a real Postgres.

Commands go through the real command handler (one transaction, as the bus would run it); results
are read from the gateway's outbox, which is what the relay would publish.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import prometheus_client
import pytest_asyncio
import yaml
from pydantic import SecretStr

from gpuaas_common.bus import HandlerContext, deliver
from gpuaas_common.bus_parsing import parse_message
from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.db import create_pool
from gpuaas_common.logging import configure_logging
from gpuaas_common.migrations import apply_migrations
from gpuaas_common.unit_of_work import UnitOfWork
from gpuaas_dev.maas_sim import Fault, SimConfig, start, state_of, system_id_for
from gpuaas_dev.testing.waiting import eventually
from gpuaas_maas_gateway.adapters.repository import PostgresGateway, gateway_repositories
from gpuaas_maas_gateway.domain.breaker import BreakerState
from gpuaas_maas_gateway.entrypoints.main import build_clients
from gpuaas_maas_gateway.service_layer.commands import OperationHandlers
from gpuaas_maas_gateway.service_layer.worker import OperationWorker
from gpuaas_maas_gateway.settings import GatewaySettings, MaasSite, SiteProfile

KEY = "Gw7sQ2mZp9LxVb3Nq4:Gt8wR1nYc6HjDf2Gs5:Gs3vB9mQ7pL2kJ8hG4fD1sA6zX0cV5bN"
EAST_KEY = "Ea1sQ2mZp9LxVb3Nq4:Et8wR1nYc6HjDf2Gs5:Es3vB9mQ7pL2kJ8hG4fD1sA6zX0cV5bN"


def settings_for(url: str, **overrides: Any) -> GatewaySettings:
    values: dict[str, Any] = dict(
        maas_url=url,
        maas_api_key=SecretStr(KEY),
        maas_timeout_s=0.3,
        maas_poll_interval_s=0.03,
        maas_grace_s=0.4,
        maas_deadline_s=30.0,
        maas_max_concurrency=32,
        maas_retry_after_cap_s=0.2,
        maas_breaker_failures=3,
        maas_breaker_cooldown_s=0.3,
        maas_upload_chunk_bytes=64 * 1024,
        site_profiles={
            "h200-baremetal": SiteProfile(
                distro_series="noble",
                tags=("gpuaas-profile-bm", "h200"),
                bootstrap_user_data="runcmd: [site-bootstrap]",
            )
        },
    )
    values.update(overrides)
    return GatewaySettings(**values)


class Gateway:
    def __init__(self, pool: asyncpg.Pool, settings: GatewaySettings) -> None:
        self.pool = pool
        self.settings = settings
        self.handlers = OperationHandlers(settings)
        self.clients = build_clients(settings)
        self.worker = OperationWorker(settings, PostgresGateway(pool), self.clients)
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Gateway:
        self.task = asyncio.ensure_future(self.worker.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.worker.aclose()
        for client in self.clients.values():
            await client.close()

    async def command(self, type_: str, **payload: Any) -> str:
        model = spec_for(type_).model(**payload)
        env = Envelope.wrap(type_, model.model_dump(mode="json"), producer="test", correlation_id="t")
        ctx = HandlerContext(env, model, spec_for(type_).address, "maas-gateway-commands", 1)
        assert await deliver(
            self.handlers.on_command, ctx, UnitOfWork(self.pool, "maas_gateway", "maas-gateway", gateway_repositories)
        )
        return payload["operation_id"]

    async def deploy(self, system_id: str, op_id: str, site: str = "default") -> str:
        return await self.command(
            "maas.deploy_requested",
            operation_id=op_id,
            allocation_id=uuid.uuid4(),
            site=site,
            system_id=system_id,
            node_id=f"node-{system_id}",
            profile="h200-baremetal",
        )

    async def release(self, system_id: str, op_id: str, erase_mode: str | None = None) -> str:
        return await self.command(
            "maas.release_requested",
            operation_id=op_id,
            allocation_id=uuid.uuid4(),
            site="default",
            system_id=system_id,
            node_id=f"node-{system_id}",
            erase_mode=erase_mode,
        )

    async def op(self, op_id: str) -> dict[str, Any]:
        row = await self.pool.fetchrow("SELECT * FROM maas_operations WHERE operation_id = $1", op_id)
        assert row is not None
        return dict(row)

    async def finished(self, op_id: str, timeout: float = 20.0) -> dict[str, Any]:
        async def done() -> dict[str, Any] | None:
            row = await self.op(op_id)
            return row if row["state"] in ("succeeded", "failed") else None

        return await eventually(done, timeout=timeout, interval=0.02, what=f"operation {op_id} finished")

    async def events(self) -> list[dict[str, Any]]:
        rows = await self.pool.fetch("SELECT subject, body FROM outbox ORDER BY id")
        return [{"subject": r["subject"], **json.loads(bytes(r["body"]))} for r in rows]

    async def result_of(self, op_id: str) -> dict[str, Any]:
        found = [
            e
            for e in await self.events()
            if e["payload"].get("operation_id") == op_id and e["subject"].startswith("gpuaas.maas.result.")
        ]
        assert len(found) == 1, found
        return found[0]

    async def preflight_of(self, op_id: str) -> dict[str, Any]:
        found = [
            e
            for e in await self.events()
            if e["payload"].get("operation_id") == op_id and e["type"] == "node.slice_preflight_reported"
        ]
        assert len(found) == 1, found
        return found[0]


@pytest_asyncio.fixture
async def pool(fresh_db: str) -> AsyncIterator[asyncpg.Pool]:
    conn = await asyncpg.connect(fresh_db)
    await apply_migrations(conn, "maas_gateway", "gpuaas_maas_gateway.migrations")
    await conn.close()
    p = await create_pool(fresh_db, "maas_gateway", min_size=2, max_size=20)
    yield p
    await p.close()


async def start_sim(machines: int | list[dict[str, Any]], port: int = 0, **timers: float) -> tuple[Any, int]:
    config = SimConfig(machines=machines, api_key=KEY, seed=7)
    config.timers = config.timers.updated(
        **{"deploying": 0.05, "releasing": 0.03, "disk_erasing": 0.03, "commissioning": 0.05, "testing": 0.05, **timers}
    )
    return await start(config, "127.0.0.1", port)


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}/MAAS/"


# ---- chaos -------------------------------------------------------------------------------------------


async def test_chaos_200_deploy_release_cycles_resolve_to_the_true_outcome(pool: asyncpg.Pool) -> None:
    machines, cycles_each = 20, 10
    runner, port = await start_sim(machines)
    sim = state_of(runner)
    sids = [system_id_for(f"bm-{i:02d}") for i in range(1, machines + 1)]
    # 30 % of mutation answers are lost after MAAS committed (deploys held past the client timeout,
    # releases dropped), 10 % are 503: half after the commit, half before it (nothing changed).
    for op in ("deploy", "release"):
        sim.faults.add(
            Fault(
                "lost_after_commit",
                op=op,
                probability=0.3,
                mode="hold" if op == "deploy" else "close",
                hold_seconds=3.0,
            )
        )
        sim.faults.add(Fault("unavailable", op=op, probability=0.05, commit=True, retry_after=0.1))
        sim.faults.add(Fault("unavailable", op=op, probability=0.05, commit=False, retry_after=0.1))
    uncommitted = {f.op: f for f in sim.faults.list() if f.kind == "unavailable" and not f.commit}
    lost = {f.op: f for f in sim.faults.list() if f.kind == "lost_after_commit"}
    # While a deploy is unknown, every deploy call MAAS receives for that machine is recorded here.
    overlapping: list[str] = []

    try:
        async with Gateway(pool, settings_for(url(port))) as gw:

            async def cycle_machine(sid: str) -> None:
                for i in range(cycles_each):
                    deploy_id = await gw.deploy(sid, f"d-{sid}-{i}")
                    row = await gw.finished(deploy_id)
                    assert row["state"] == "succeeded", row
                    release_id = await gw.release(sid, f"r-{sid}-{i}")
                    row = await gw.finished(release_id)
                    assert row["state"] == "succeeded", row

            async def watch_overlap() -> None:
                # Sample: a machine whose deploy stayed unknown between two samples must not have
                # received a deploy call in between.
                before: dict[str, int] = {}
                while True:
                    unknown = {
                        r["system_id"]
                        for r in await pool.fetch(
                            "SELECT system_id FROM maas_operations WHERE kind = 'deploy' AND state = 'unknown'"
                        )
                    }
                    now = {sid: sim.call_count("deploy", sid) for sid in unknown}
                    overlapping.extend(sid for sid, calls in now.items() if sid in before and calls > before[sid])
                    before = now
                    # A monitor's sampling period, not a wait for anything: the invariant is also proven
                    # exactly below by the per-machine deploy counts and the attempts/calls equality.
                    await asyncio.sleep(0.005)

            watcher = asyncio.ensure_future(watch_overlap())
            try:
                await asyncio.wait_for(asyncio.gather(*(cycle_machine(s) for s in sids)), timeout=50)
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)

            ops = [dict(r) for r in await pool.fetch("SELECT * FROM maas_operations")]
            events = await gw.events()
    finally:
        await runner.cleanup()

    deploys = [o for o in ops if o["kind"] == "deploy"]
    releases = [o for o in ops if o["kind"] == "release"]
    assert len(deploys) == len(releases) == machines * cycles_each == 200
    assert {o["state"] for o in ops} == {"succeeded"}
    unknown_ops = [o for o in ops if o["resolution"] == "polled"]
    resubmitted = {k: sum(o["resubmits"] for o in ops if o["kind"] == k) for k in ("deploy", "release")}
    # Every uncommitted 503 (and only those) led to one resubmit: MAAS showed the machine untouched.
    assert resubmitted == {k: uncommitted[k].fired for k in ("deploy", "release")}
    # MAAS received exactly one call per attempt the gateway counted, and no deploy ever met a
    # machine that was already deploying (that answer would be a 409).
    for kind in ("deploy", "release"):
        assert sim.call_count(kind) == sum(o["maas_calls"] for o in ops if o["kind"] == kind)
        assert 409 not in sim.responses[kind]
    assert overlapping == []
    for sid in sids:
        history = sim.machines[sid].history
        assert sum(1 for t in history if t.reason == "deploy") == cycles_each
        assert sim.machines[sid].status.label == "Ready"
    assert not [o for o in ops if o["unknown_since"] is not None and o["updated_at"] > o["deadline_at"]]
    # One result event per operation, all telling the truth (deployed / released).
    results = [e for e in events if e["type"] in ("maas.deploy_result", "maas.release_result")]
    assert len(results) == 400
    assert {e["payload"]["status"] for e in results} == {"deployed", "released"}
    counts = {
        "operations": len(ops),
        "unknown_outcomes": len(unknown_ops),
        "lost_after_commit_fired": {k: f.fired for k, f in lost.items()},
        "uncommitted_503_fired": {k: f.fired for k, f in uncommitted.items()},
        "resubmits": resubmitted,
        "maas_deploy_calls": sim.call_count("deploy"),
        "maas_release_calls": sim.call_count("release"),
    }
    print("chaos counts:", json.dumps(counts))
    assert len(unknown_ops) >= 80  # about 40 % of 400 mutations had no clear answer
    assert all(f.fired > 0 for f in (*lost.values(), *uncommitted.values()))


# ---- outage and the circuit breaker -------------------------------------------------------------------


async def test_maas_outage_opens_the_breaker_commands_wait_and_all_complete_after(pool: asyncpg.Pool) -> None:
    runner, port = await start_sim(4)
    await runner.cleanup()  # MAAS is down before the commands arrive
    sids = [system_id_for(f"bm-{i:02d}") for i in range(1, 5)]
    async with Gateway(pool, settings_for(url(port))) as gw:
        site = gw.worker.sites["default"]
        ops = [await gw.deploy(sid, f"outage-{sid}") for sid in sids]
        await eventually(lambda: site.breaker.opened_count >= 2, timeout=10, what="breaker opened twice")
        assert site.breaker.state in (BreakerState.OPEN, BreakerState.HALF_OPEN)
        metrics = prometheus_client.generate_latest().decode()
        assert 'gpuaas_maas_breaker_opened_total{site="default"}' in metrics
        assert 'gpuaas_maas_breaker_state{site="default"}' in metrics
        rows = [await gw.op(o) for o in ops]
        # Waiting, not failed and not unknown: an attempt that the breaker or the refused connection turns
        # back reads as `submitting` for the moment it takes, then `pending` again.
        assert {r["state"] for r in rows} <= {"pending", "submitting"}
        assert await gw.events() == []
        # While open, the breaker keeps calls away from MAAS: far fewer attempts than polls.
        attempts = sum(r["maas_calls"] for r in rows)
        assert attempts <= 3 + site.breaker.opened_count

        runner, _ = await start_sim(4, port=port)
        try:
            rows = [await gw.finished(o) for o in ops]
            assert {r["state"] for r in rows} == {"succeeded"}
            assert site.breaker.state is BreakerState.CLOSED
            sim = state_of(runner)
            assert all(sim.call_count("deploy", sid) == 1 for sid in sids)
            assert 'gpuaas_maas_breaker_state{site="default"} 0.0' in prometheus_client.generate_latest().decode()
        finally:
            await runner.cleanup()


async def test_retry_after_of_a_conflict_is_honoured_and_nothing_is_doubled(pool: asyncpg.Pool) -> None:
    runner, port = await start_sim(1)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    sim.faults.add(Fault("conflict", op="deploy", count=2, retry_after=1))
    try:
        async with Gateway(pool, settings_for(url(port), maas_retry_after_cap_s=5.0)) as gw:
            op = await gw.deploy(sid, "conflicted")
            row = await gw.finished(op)
            assert row["state"] == "succeeded" and row["maas_calls"] == 3
            history = [t for t in sim.machines[sid].history if t.reason == "deploy"]
            assert len(history) == 1
            # Two 409s with Retry-After: 1 mean the successful call came at least 2 s after the command.
            assert (row["updated_at"] - row["created_at"]).total_seconds() >= 2.0
    finally:
        await runner.cleanup()


# ---- resubmission is never a blind repeat ---------------------------------------------------------------


async def test_unknown_deploy_is_not_resubmitted_while_maas_shows_deploying(pool: asyncpg.Pool) -> None:
    # A long deploy and a tiny grace: the machine is Deploying for far longer than the grace, and
    # the lost answer must still be resolved by watching it, not by deploying again.
    runner, port = await start_sim(1, deploying=1.5)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    sim.faults.add(Fault("lost_after_commit", op="deploy", count=1, mode="close"))
    try:
        async with Gateway(pool, settings_for(url(port), maas_grace_s=0.05)) as gw:
            op = await gw.deploy(sid, "slow")
            row = await gw.finished(op)
            assert row["state"] == "succeeded" and row["resubmits"] == 0 and row["maas_calls"] == 1
            assert sim.call_count("deploy", sid) == 1
            assert (await gw.result_of(op))["payload"]["resolution"] == "polled"
    finally:
        await runner.cleanup()


async def test_a_second_operation_waits_while_the_machine_has_an_unknown_one(pool: asyncpg.Pool) -> None:
    runner, port = await start_sim(1, deploying=0.3)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    sim.faults.add(Fault("lost_after_commit", op="deploy", count=1, mode="hold", hold_seconds=3))
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            first = await gw.deploy(sid, "first")
            await eventually(lambda: gw.op(first), what="recorded")

            async def unknown() -> bool:
                return (await gw.op(first))["state"] == "unknown"

            await eventually(unknown, timeout=5, interval=0.01, what="first deploy unknown")
            second = await gw.release(sid, "second")
            row = await gw.finished(first)
            assert row["state"] == "succeeded"
            row2 = await gw.finished(second)
            assert row2["state"] == "succeeded"
            # The release went out only after the deploy was resolved.
            deploy_done = next(t.at for t in sim.machines[sid].history if t.to_status.label == "Deployed")
            release_at = next(t.at for t in sim.machines[sid].history if t.reason == "release")
            assert release_at >= deploy_done
    finally:
        await runner.cleanup()


# ---- failure with MAAS's message -------------------------------------------------------------------------


async def test_failed_deployment_is_reported_with_maas_status_message(pool: asyncpg.Pool) -> None:
    runner, port = await start_sim(1)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    sim.faults.add(
        Fault(
            "failed_deployment",
            op="deploy",
            count=1,
            status_message="Failed deployment: curtin failed to install the kernel",
        )
    )
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            op = await gw.deploy(sid, "doomed")
            assert (await gw.finished(op))["state"] == "failed"
            payload = (await gw.result_of(op))["payload"]
            assert payload["status"] == "failed" and payload["reason_code"] == "maas_failed"
            assert payload["maas_status_name"] == "Failed deployment"
            assert payload["status_message"] == "Failed deployment: curtin failed to install the kernel"
    finally:
        await runner.cleanup()


async def test_a_deploy_hands_the_tenants_keys_to_the_machine_and_answers_where_to_log_in(pool: asyncpg.Pool) -> None:
    runner, port = await start_sim(1)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITenant tenant@laptop"
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            op = await gw.command(
                "maas.deploy_requested",
                operation_id="dep-keys",
                allocation_id=uuid.uuid4(),
                site="default",
                system_id=sid,
                node_id="node-bm-01",
                profile="h200-baremetal",
                ssh_public_keys=[key],
            )
            assert (await gw.finished(op))["state"] == "succeeded"
            result = await gw.result_of(op)
    finally:
        await runner.cleanup()
    # The keys reach the machine as MAAS passes user-data through: cloud-init gives them to the default user.
    sent = sim.machines[sid].last_deploy
    assert sent is not None and yaml.safe_load(sent["user_data"].decode())["ssh_authorized_keys"] == [key]
    body = {k: v for k, v in result.items() if k != "subject"}
    _, payload_model = parse_message(result["subject"], json.dumps(body).encode())  # checked against the contract
    payload = payload_model.model_dump(mode="json")
    assert payload["ip_addresses"] == [sim.machines[sid].ip_address] and payload["login_user"] == "ubuntu"


# ---- lifecycle: commission, tags, image upload, profile image -----------------------------------------


async def test_commission_with_named_scripts_survives_a_lost_answer(pool: asyncpg.Pool) -> None:
    runner, port = await start_sim(2)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    sim.faults.add(Fault("lost_after_commit", op="commission", count=1, mode="close"))
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            op = await gw.command(
                "maas.commission_requested",
                operation_id="comm-1",
                site="default",
                system_id=sid,
                commissioning_scripts=["gpuaas-h200-firmware", "update_firmware"],
                scripts=[{"name": "gpuaas-h200-firmware", "script": "#!/bin/sh\necho fw\n"}],
            )
            row = await gw.finished(op)
            assert row["state"] == "succeeded" and row["resubmits"] == 0, row
            payload = (await gw.result_of(op))["payload"]
            assert payload["status"] == "succeeded" and payload["maas_status_name"] == "Ready"
            assert payload["resolution"] == "polled"
            machine = sim.machines[sid]
            assert machine.commissioning_scripts == ("gpuaas-h200-firmware", "update_firmware")
            assert machine.current_commissioning_result_id == 1 and sim.call_count("commission", sid) == 1
            assert "gpuaas-h200-firmware" in sim.scripts.scripts

            bad = await gw.command(
                "maas.commission_requested",
                operation_id="comm-2",
                site="default",
                system_id=sid,
                commissioning_scripts=["no-such-script"],
            )
            payload = (await gw.finished(bad)) and (await gw.result_of(bad))["payload"]
            assert payload["status"] == "failed" and payload["reason_code"] == "maas_http_400"
            assert "no-such-script" in payload["status_message"]
    finally:
        await runner.cleanup()


async def test_sync_profile_tags_creates_tags_and_updates_nodes(pool: asyncpg.Pool) -> None:
    runner, port = await start_sim(3)
    sim = state_of(runner)
    a, b, c = (system_id_for(f"bm-{i:02d}") for i in (1, 2, 3))
    sim.ensure_tag("h200")
    sim.machines[c].tags.add("gpuaas-profile-bm")
    sim.faults.add(Fault("gateway_timeout", op="tag.update_nodes", count=1))
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            op = await gw.command(
                "maas.tags_sync_requested",
                operation_id="tags-1",
                site="default",
                profile="h200-baremetal",
                add_system_ids=[a, b],
                remove_system_ids=[c],
            )
            assert (await gw.finished(op))["state"] == "succeeded"
            payload = (await gw.result_of(op))["payload"]
            assert payload["tags"] == ["gpuaas-profile-bm", "h200"] and payload["resolution"] == "polled"
            assert "gpuaas-profile-bm" in sim.tags
            assert {s for s, mm in sim.machines.items() if "gpuaas-profile-bm" in mm.tags} == {a, b}
            assert {s for s, mm in sim.machines.items() if "h200" in mm.tags} == {a, b}
    finally:
        await runner.cleanup()


async def test_upload_image_then_switch_profile_and_back(pool: asyncpg.Pool, tmp_path: Path) -> None:
    runner, port = await start_sim(1)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    image = tmp_path / "gpuaas-h200-host-ubuntu2404.tar.gz"
    content = random.Random(3).randbytes(300_000)  # 5 chunks of 64 KiB
    image.write_bytes(content)
    digest = hashlib.sha256(content).hexdigest()
    # The create's answer and one chunk's answer are lost after MAAS stored them.
    sim.faults.add(Fault("lost_after_commit", op="boot_resources.create", count=1, mode="close"))
    sim.faults.add(Fault("lost_after_commit", op="boot_resource.upload", count=1, mode="close"))
    sim.faults.add(Fault("unavailable", op="boot_resource.upload", count=1, commit=False, retry_after=0.1))
    settings = settings_for(url(port), maas_uploaded_images=())
    try:
        async with Gateway(pool, settings) as gw:
            switch = await gw.command(
                "maas.profile_image_set_requested",
                operation_id="sw-0",
                site="default",
                profile="h200-baremetal",
                distro_series="gpuaas-h200-host-ubuntu2404x",
            )
            payload = (await gw.finished(switch)) and (await gw.result_of(switch))["payload"]
            assert payload["status"] == "failed" and payload["reason_code"] == "image_not_uploaded"

            up = await gw.command(
                "maas.image_upload_requested",
                operation_id="up-1",
                site="default",
                name="custom/gpuaas-h200-host-ubuntu2404x",
                title="GPUaaS H200 Host Ubuntu 24.04",
                source_path=str(image),
                sha256=digest,
                size=len(content),
            )
            row = await gw.finished(up)
            assert row["state"] == "succeeded", row
            payload = (await gw.result_of(up))["payload"]
            assert payload["name"] == "custom/gpuaas-h200-host-ubuntu2404x" and payload["sha256"] == digest
            resource = sim.boot_resources.get(payload["boot_resource_id"])
            assert resource.name == "gpuaas-h200-host-ubuntu2404x" and resource.complete
            assert sim.call_count("boot_resources.create") == 1
            stored = await pool.fetchrow("SELECT * FROM maas_boot_resources")
            assert (stored["boot_resource_id"], stored["sha256"], stored["filetype"]) == (resource.id, digest, "tgz")

            switch = await gw.command(
                "maas.profile_image_set_requested",
                operation_id="sw-1",
                site="default",
                profile="h200-baremetal",
                distro_series="gpuaas-h200-host-ubuntu2404x",
            )
            payload = (await gw.finished(switch)) and (await gw.result_of(switch))["payload"]
            assert payload["status"] == "succeeded" and payload["previous_distro_series"] == "noble"
            assert payload["deploy_distro_series"] == "custom/gpuaas-h200-host-ubuntu2404x"

            assert (await gw.finished(await gw.deploy(sid, "dep-custom")))["state"] == "succeeded"
            last = sim.machines[sid].last_deploy
            assert last is not None and (last["osystem"], last["distro_series"]) == (
                "custom",
                "gpuaas-h200-host-ubuntu2404x",
            )
            user_data = last["user_data"].decode()
            assert "GPUAAS_ENROLMENT_TOKEN=" in user_data
            assert yaml.safe_load(user_data)["runcmd"] == ["site-bootstrap"]
            assert (await gw.finished(await gw.release(sid, "rel-custom")))["state"] == "succeeded"
            assert sim.machines[sid].history[-2].to_status.label == "Disk erasing"  # every release erases

            back = await gw.command(
                "maas.profile_image_set_requested",
                operation_id="sw-2",
                site="default",
                profile="h200-baremetal",
                distro_series="ubuntu/noble",
            )
            payload = (await gw.finished(back)) and (await gw.result_of(back))["payload"]
            assert payload["distro_series"] == "ubuntu/noble" and payload["deploy_distro_series"] == "ubuntu/noble"
            assert payload["previous_distro_series"] == "gpuaas-h200-host-ubuntu2404x"
            assert (await gw.finished(await gw.deploy(sid, "dep-stock")))["state"] == "succeeded"
            assert (sim.machines[sid].osystem, sim.machines[sid].distro_series) == ("ubuntu", "noble")
    finally:
        await runner.cleanup()


# ---- per-site keys stay secret --------------------------------------------------------------------------


async def test_site_api_keys_never_reach_logs_or_events(pool: asyncpg.Pool) -> None:
    runner, port = await start_sim(2)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    # The east site's token is wrong: MAAS echoes a rejected token in its 401 body.
    wrong_east = EAST_KEY.split(":")[0] + ":" + KEY.split(":")[1][:-1] + "X:" + EAST_KEY.split(":")[2]
    sim.verifier.add_key(type(sim.config.key).parse(EAST_KEY))
    sim.faults.add(Fault("lost_after_commit", op="deploy", count=1, mode="close"))
    sim.faults.add(Fault("server_error", op="release", count=1))
    stream = io.StringIO()
    configure_logging("maas-gateway", "DEBUG", stream=stream)
    settings = settings_for(url(port), maas_sites={"east": MaasSite(url=url(port), api_key=SecretStr(wrong_east))})
    try:
        async with Gateway(pool, settings) as gw:
            ok = await gw.deploy(sid, "secret-1")
            assert (await gw.finished(ok))["state"] == "succeeded"
            assert (await gw.finished(await gw.release(sid, "secret-2")))["state"] == "succeeded"
            east = await gw.deploy(system_id_for("bm-02"), "secret-3", site="east")
            assert (await gw.finished(east))["state"] == "failed"
            payload = (await gw.result_of(east))["payload"]
            assert payload["reason_code"] == "maas_http_401" and "**redacted**" in payload["status_message"]
            texts = [
                stream.getvalue(),
                repr(settings),
                str(settings),
                settings.model_dump_json(),
                json.dumps(await gw.events()),
                repr(gw.clients),
                repr(gw.worker.sites),
                json.dumps([dict(r) for r in await pool.fetch("SELECT * FROM maas_operations")], default=str),
            ]
    finally:
        configure_logging("tests", "INFO")
        await runner.cleanup()
    everything = "\n".join(texts)
    assert "secret-1" in everything and "maas_outcome_unknown" in everything
    for key in (KEY, EAST_KEY, wrong_east):
        for part in key.split(":"):
            assert part not in everything, "a MAAS key part leaked"


PREFLIGHT_SCRIPT = {"name": "50-gpuaas-slice-firmware-preflight", "script": "#!/bin/bash\necho preflight\n"}


async def test_commission_publishes_the_judged_slice_preflight(pool: asyncpg.Pool) -> None:
    """Passed, failed (the script exits 1, MAAS fails commissioning) and missing (the run did not
    include the script): each comes with the commission result, in the same unit of work."""
    runner, port = await start_sim(2)
    sim = state_of(runner)
    sid, other = system_id_for("bm-01"), system_id_for("bm-02")
    sim.machines[other].preflight_failures = {"bios_proc_virtualization": "ProcVirtualization=Disabled"}
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            cases = [
                ("pf-ok", sid, [PREFLIGHT_SCRIPT["name"]], "succeeded", "passed"),
                ("pf-bad", other, [PREFLIGHT_SCRIPT["name"]], "failed", "failed"),
                ("pf-none", sid, ["update_firmware"], "succeeded", "missing"),
            ]
            for op_id, system_id, scripts, outcome, preflight in cases:
                op = await gw.command(
                    "maas.commission_requested",
                    operation_id=op_id,
                    site="default",
                    system_id=system_id,
                    node_id="slice-01",
                    commissioning_scripts=scripts,
                    scripts=[PREFLIGHT_SCRIPT],
                )
                await gw.finished(op)
                result = (await gw.result_of(op))["payload"]
                report = await gw.preflight_of(op)
                assert report["subject"] == "gpuaas.maas.report.slice_preflight"
                payload = report["payload"]
                assert (op_id, result["status"], payload["status"]) == (op_id, outcome, preflight), payload
                assert payload["system_id"] == system_id and payload["node_id"] == "slice-01"
                assert payload["result_set_id"] == sim.machines[system_id].current_commissioning_result_id
                if preflight == "passed":
                    assert payload["reasons"] == [] and len(payload["nvme"]) == 9
                    assert {c["check"] for c in payload["checks"]} >= {"kvm", "iommu", "gpu", "bf3", "sriov"}
                elif preflight == "failed":
                    assert result["maas_status_name"] == "Failed commissioning"
                    assert any("ProcVirtualization=Disabled" in r for r in payload["reasons"]), payload
                    assert any("exited with 1" in r for r in payload["reasons"])
                else:
                    assert payload["reasons"] == ["the commissioning run has no preflight script result"]
    finally:
        await runner.cleanup()


async def test_the_poll_loop_outlives_a_database_that_goes_away(pool: asyncpg.Pool) -> None:
    """Postgres restarting under the gateway: the claim statement fails a few times, and the poll loop waits
    and carries on. It used to die with the first error, taking the gateway process with it."""
    runner, port = await start_sim(1)
    sid = system_id_for("bm-01")
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            real, failures = gw.worker.read.operations.claim_due, []

            async def outage(*args: Any, **kwargs: Any) -> Any:
                if len(failures) < 3:
                    failures.append(1)
                    raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")
                return await real(*args, **kwargs)

            gw.worker.read.operations.claim_due = outage  # type: ignore[method-assign]
            op = await gw.deploy(sid, "after-outage")
            row = await gw.finished(op)
            assert len(failures) == 3
            assert row["state"] == "succeeded" and row["maas_calls"] == 1
            assert gw.task is not None and not gw.task.done()
    finally:
        await runner.cleanup()


async def test_a_command_asked_again_after_it_finished_gets_its_result_again_and_calls_nothing(
    pool: asyncpg.Pool,
) -> None:
    """The allocator lost its commit of a deploy result (a database crash without synchronous commit) and sends
    the deploy again: the gateway answers with the stored result under a new id and MAAS is not called again."""
    runner, port = await start_sim(1)
    sim = state_of(runner)
    sid = system_id_for("bm-01")
    try:
        async with Gateway(pool, settings_for(url(port))) as gw:
            op = await gw.deploy(sid, "deploy-again")
            assert (await gw.finished(op))["state"] == "succeeded"
            await gw.command(
                "maas.deploy_requested",
                operation_id=op,
                allocation_id=(await gw.op(op))["allocation_id"],
                site="default",
                system_id=sid,
                node_id=f"node-{sid}",
                profile="h200-baremetal",
            )
            results = [
                e for e in await gw.events() if e["type"] == "maas.deploy_result" and e["payload"]["operation_id"] == op
            ]
            assert len(results) == 2 and results[0]["event_id"] != results[1]["event_id"]
            assert results[0]["payload"] == results[1]["payload"]
            assert sim.call_count("deploy", sid) == 1
    finally:
        await runner.cleanup()
