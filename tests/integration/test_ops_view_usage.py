"""Usage records of the ops read models (services/ops-view, domain/usage.py has the rule) against a real
nats-server and Postgres: lifecycle events published on the bus as the allocator and the scheduler send them, with
the times they carry, are followed into the running read models; the ops API answers a tenant's month; the outbox
relay publishes one `usage.recorded` per allocation that was active; `gpuaas usage export` prints the month.

One test per case: release while provisioning, failed before active and unschedulable leave no record; a forced
release ends one; a record crossing month boundaries is split exactly; replays, duplicates, a restart and a
rebuild from the streams change nothing; and a scripted month whose records add up exactly. Every message these
tests publish, and every one the relay publishes, is checked against the committed contract (a BusSpy on the
whole bus, and the validator before each publish)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import aiohttp
import asyncpg
import nats
import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.jetstream import provision
from gpuaas_common.outbox import OutboxRelay
from gpuaas_dev.cli import app
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.waiting import eventually

from .test_ops_view import BILLING_TOKEN, SCHEMA, TOKEN, View, _close, _slot, _start_view, caught_up, get

UTC = timezone.utc
SHA = "b" * 64
DAY = 86400


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@dataclass
class Usage:
    """A read-model follower set with its ops API and the outbox relay that publishes what it raises."""

    view: View
    relay: OutboxRelay
    relay_task: asyncio.Task[None]
    dsn: str

    async def close(self) -> None:
        self.relay.stop()
        self.relay_task.cancel()
        await asyncio.gather(self.relay_task, return_exceptions=True)
        await _close(self.view)


async def _start_usage(nc: nats.NATS, dsn: str) -> Usage:
    view = await _start_view(nc, dsn, f"ou-{uuid.uuid4().hex[:8]}")
    relay = OutboxRelay(dsn, SCHEMA, nc.jetstream(), poll_interval_s=0.2)
    return Usage(view, relay, asyncio.create_task(relay.run()), dsn)


@pytest.fixture
async def nc(nats_server) -> AsyncIterator[nats.NATS]:
    client = await nats.connect(nats_server.url)
    await provision(client.jetstream())
    yield client
    await client.drain()


@pytest.fixture
async def spy(nats_server) -> AsyncIterator[BusSpy]:
    s = await BusSpy(nats_server.url).start()
    yield s
    await s.stop()
    assert s.violations == [], s.violations


@pytest.fixture
async def usage(nc: nats.NATS, fresh_db: str, spy: BusSpy) -> AsyncIterator[Usage]:
    u = await _start_usage(nc, fresh_db)
    yield u
    await u.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
        yield session


async def send(
    nc: nats.NATS, type_: str, payload: BaseModel, when: datetime, *, producer: str, event_id: str | None = None
) -> str:
    """One event as its producer sends it, carrying `when` as its occurred_at; checked against the committed
    contract before it goes out."""
    env = Envelope(
        event_id=event_id or str(uuid.uuid4()),
        type=type_,
        schema_version=1,
        occurred_at=when,
        correlation_id=str(getattr(payload, "allocation_id", uuid.uuid4())),
        producer=producer,
        payload=payload.model_dump(mode="json"),
    )
    subject = spec_for(type_).subject()
    body = env.model_dump_json().encode()
    default_validator().validate(subject, body)
    ack = await nc.jetstream().publish(subject, body, headers={"Nats-Msg-Id": env.event_id})
    assert ack.stream
    return env.event_id


class Alloc:
    """One allocation's lifecycle as the allocator publishes it: each move the next seq, at the given time."""

    def __init__(self, nc: nats.NATS, tenant: str, *, shape: str = "gpu_slice", gpus: int = 2) -> None:
        self.nc, self.tenant, self.shape, self.gpus = nc, tenant, shape, gpus
        self.id = uuid.uuid4()
        self.node = f"n-{self.id.hex[:8]}"
        self.seq = 0
        self.state: str | None = None
        self.sent: list[tuple[str, BaseModel, datetime, str]] = []  # (type, payload, when, event id)

    def _fields(self, state: str) -> dict[str, Any]:
        node = self.node
        sku = "h200-sxm-slice" if self.shape == "gpu_slice" else "h200-sxm"
        image = m.ImageRef(slug="debian-12", digest_sha256=SHA, image_path="/i/debian-12.raw")
        return {
            "accepted": {"sku": sku, "gpu_count": self.gpus, "region": "default", "image": image},
            "placed": {"node_id": node, "claim_mode": "slots", "slots": [_slot(node, i) for i in range(self.gpus)]},
            "unschedulable": {"reason_code": "no_capacity", "reason": "no node", "free_gpus": 0, "requested_gpus": 2},
            "provisioning": {"node_id": node, "task_id": f"t-{self.id.hex[:12]}"},
            "active": {"node_id": node, "access": m.AccessInfo(ip="10.100.0.11", ssh_ready=True)},
            "releasing": {"reason": "tenant asked"},
            "released": {"node_id": node, "cleanup": m.CleanupReport(required=True, verified=True)},
        }.get(state, {})

    async def move(self, state: str, when: str, **extra: Any) -> str:
        self.seq += 1
        model = spec_for(f"allocation.{state}").model
        payload = model(
            allocation_id=self.id,
            tenant_id=self.tenant,
            shape=self.shape,
            state=state,
            previous_state=self.state,
            seq=self.seq,
            **{**self._fields(state), **extra},
        )
        self.state = state
        event_id = await send(self.nc, f"allocation.{state}", payload, at(when), producer="allocator")
        self.sent.append((f"allocation.{state}", payload, at(when), event_id))
        return event_id

    async def fail(self, when: str, code: str = "provisioning_failed", *, cleanup: bool = True) -> str:
        return await self.move(
            "failed", when, reason_code=code, reason=code, node_id=self.node, cleanup_required=cleanup
        )

    async def walk(self, *moves: tuple[str, str]) -> None:
        for state, when in moves:
            await self.move(state, when)

    async def up(self, placed: str, active: str) -> None:
        """accepted, placed and provisioning at `placed`, active at `active`."""
        await self.walk(("accepted", placed), ("placed", placed), ("provisioning", placed), ("active", active))


async def month(http: aiohttp.ClientSession, u: Usage, tenant: str, month: str, **q: str) -> dict[str, Any]:
    await caught_up(http, u.view)
    status, body = await get(http, f"{u.view.url}/v1/usage", tenant=tenant, month=month, **q)
    assert status == 200, body
    return body


def records(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["allocation_id"]: r for r in body["items"]}


async def published(nc: nats.NATS, spy: BusSpy, ids: list[uuid.UUID]) -> dict[str, list[dict[str, Any]]]:
    """The usage.recorded the USAGE stream holds for `ids`, each checked against the contract, once the relay has
    published one for each (seen live by the spy)."""
    await eventually(
        lambda: all(spy.of_type("usage.recorded", allocation_id=str(i)) for i in ids),
        20,
        what="usage.recorded published for each allocation",
    )
    js = nc.jetstream()
    info = await js.stream_info("USAGE")
    found: dict[str, list[dict[str, Any]]] = {str(i): [] for i in ids}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg("USAGE", seq)
        data = default_validator().validate(msg.subject, msg.data)
        if data["payload"]["allocation_id"] in found:
            found[data["payload"]["allocation_id"]].append(data)
    return found


async def test_released_while_provisioning_is_no_usage(nc, usage: Usage, http, spy) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = Alloc(nc, tenant)
    await a.walk(("accepted", "2026-10-03 10:00:00"), ("placed", "2026-10-03 10:00:01"))
    await a.walk(("provisioning", "2026-10-03 10:00:02"), ("releasing", "2026-10-03 10:01:00"))
    # The provision succeeded while the release waited: the VM is torn down, never handed over.
    await a.move("released", "2026-10-03 10:09:00")
    body = await month(http, usage, tenant, "2026-10")
    assert body["items"] == [] and body["totals"] == {"records": 0, "open": 0, "seconds": 0, "gpu_seconds": 0}
    _, detail = await get(http, f"{usage.view.url}/v1/allocations/{a.id}")
    assert detail["state"] == "released"


async def test_failed_before_active_is_no_usage(nc, usage: Usage, http, spy) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a, b = Alloc(nc, tenant), Alloc(nc, tenant)
    await a.walk(("accepted", "2026-10-05 08:00:00"), ("placed", "2026-10-05 08:00:01"))
    await a.move("provisioning", "2026-10-05 08:00:02")
    await a.fail("2026-10-05 08:20:00", "task_deadline_passed")
    # Forced off its claims while still placed: failed too, never active.
    await b.walk(("accepted", "2026-10-05 09:00:00"), ("placed", "2026-10-05 09:00:01"))
    await b.fail("2026-10-05 09:05:00", "force_released")
    body = await month(http, usage, tenant, "2026-10")
    assert body["items"] == [] and body["totals"]["records"] == 0


async def test_unschedulable_is_no_usage(nc, usage: Usage, http, spy) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = Alloc(nc, tenant)
    await a.walk(("accepted", "2026-10-07 12:00:00"), ("unschedulable", "2026-10-07 12:00:01"))
    body = await month(http, usage, tenant, "2026-10")
    assert body["items"] == [] and body["totals"]["records"] == 0
    _, detail = await get(http, f"{usage.view.url}/v1/allocations/{a.id}")
    assert detail["state"] == "unschedulable"


async def test_force_released_ends_the_record_when_it_failed(nc, usage: Usage, http, spy) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = Alloc(nc, tenant, gpus=4)
    await a.up("2026-10-10 06:00:00", "2026-10-10 06:04:59.999")
    # Ops force the claims free (the scheduler's event), the allocator ends the allocation as failed.
    await send(
        nc,
        "placement.force_released",
        m.PlacementForceReleased(
            allocation_id=a.id,
            node_ids=[a.node],
            slot_ids=[f"{a.node}-s0"],
            actor="ops",
            reason="host dead",
            forced=True,
        ),
        at("2026-10-10 09:00:00"),
        producer="scheduler",
    )
    await a.fail("2026-10-10 09:00:00.250", "force_released")
    body = await month(http, usage, tenant, "2026-10")
    [r] = body["items"]
    assert (r["started_at"], r["stopped_at"]) == ("2026-10-10T06:04:59Z", "2026-10-10T09:00:00Z")
    assert (r["ended"], r["end_reason_code"], r["open"]) == ("failed", "force_released", False)
    assert (r["seconds"], r["gpu_seconds"], r["gpu_count"], r["sku"]) == (10501, 4 * 10501, 4, "h200-sxm-slice")
    assert body["totals"] == {"records": 1, "open": 0, "seconds": 10501, "gpu_seconds": 42004}
    [event] = (await published(nc, spy, [a.id]))[str(a.id)]
    assert event["producer"] == "ops-view"
    assert {k: event["payload"][k] for k in ("tenant_id", "seconds", "ended", "end_reason_code", "gpu_count")} == {
        "tenant_id": tenant,
        "seconds": 10501,
        "ended": "failed",
        "end_reason_code": "force_released",
        "gpu_count": 4,
    }
    _, detail = await get(http, f"{usage.view.url}/v1/allocations/{a.id}")
    assert {c["forced_by"] for c in detail["claims"]} == {"ops"}


async def test_a_record_crossing_months_is_split_exactly(nc, usage: Usage, http, spy) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a = Alloc(nc, tenant, shape="baremetal", gpus=8)
    await a.up("2026-10-31 21:30:00", "2026-10-31 22:00:00.400")
    await a.move("releasing", "2027-01-01 00:00:00.100")
    await a.move("released", "2027-01-01 00:10:00.900")
    expected = {"2026-09": 0, "2026-10": 7200, "2026-11": 30 * DAY, "2026-12": 31 * DAY, "2027-01": 600}
    got = {}
    for name in expected:
        body = await month(http, usage, tenant, name)
        got[name] = body["totals"]["seconds"]
        assert [r["seconds"] for r in body["items"]] == ([got[name]] if got[name] else [])
        if body["items"]:
            assert body["totals"]["gpu_seconds"] == 8 * got[name]
            assert body["items"][0]["record_seconds"] == sum(expected.values())
    assert got == expected
    [event] = (await published(nc, spy, [a.id]))[str(a.id)]
    assert event["payload"]["seconds"] == sum(expected.values()) == 7200 + 61 * DAY + 600
    assert (event["payload"]["started_at"], event["payload"]["stopped_at"]) == (
        "2026-10-31T22:00:00Z",
        "2027-01-01T00:10:00Z",
    )


async def _usage_rows(pool: asyncpg.Pool, tenant: str) -> list[tuple]:
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT * FROM usage_records WHERE tenant_id = $1 ORDER BY allocation_id", tenant)
    return [tuple(r.values()) for r in rows]


async def test_replays_duplicates_restart_and_rebuild_change_nothing(
    nc, usage: Usage, http, spy, postgres_server
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    a, b = Alloc(nc, tenant), Alloc(nc, tenant)
    await a.up("2026-10-12 10:00:00", "2026-10-12 10:05:00")
    await a.move("releasing", "2026-10-12 12:00:00")
    released = await a.move("released", "2026-10-12 12:05:00")
    # A redelivery (the same message id: JetStream drops it) and a republish after a lost commit (a new id, the
    # same seq and state: the timeline takes it as a repeat).
    type_, payload, when, _ = a.sent[-1]
    await send(nc, type_, payload, when, producer="allocator", event_id=released)
    for type_, payload, when, _ in a.sent[3:]:
        await send(nc, type_, payload, when, producer="allocator")
    before = await month(http, usage, tenant, "2026-10")
    assert [r["seconds"] for r in before["items"]] == [7200]

    # A restart: the followers stop, the lifecycle goes on, they resume from their committed positions.
    await usage.view.stop()
    await b.up("2026-10-20 00:00:00", "2026-10-20 00:00:30")
    await b.fail("2026-10-20 01:00:30", "release_failed")
    usage.view.tasks.extend(asyncio.create_task(f.run()) for f in usage.view.followers)
    after = await month(http, usage, tenant, "2026-10")
    assert sorted(r["seconds"] for r in after["items"]) == [3600, 7200]
    assert after["totals"] == {"records": 2, "open": 0, "seconds": 10800, "gpu_seconds": 21600}
    events = await published(nc, spy, [a.id, b.id])
    assert {k: len(v) for k, v in events.items()} == {str(a.id): 1, str(b.id): 1}

    # A rebuild: an empty schema in another database follows the same streams from their first message.
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_server.dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    rebuilt = await _start_usage(nc, postgres_server.dsn.rsplit("/", 1)[0] + f"/{name}")
    try:
        again = await month(http, rebuilt, tenant, "2026-10")
        assert again["items"] == after["items"] and again["totals"] == after["totals"]
        assert await _usage_rows(rebuilt.view.pool, tenant) == await _usage_rows(usage.view.pool, tenant)

        async def relayed() -> bool:
            async with rebuilt.view.pool.acquire() as conn:
                return await conn.fetchval("SELECT count(*) FROM outbox") == 0

        # The rebuild published its records again, under the same event ids: the stream kept one of each.
        await eventually(relayed, 20, what="the rebuild's outbox relayed")
        events = await published(nc, spy, [a.id, b.id])
        assert {k: len(v) for k, v in events.items()} == {str(a.id): 1, str(b.id): 1}
    finally:
        await rebuilt.close()
        admin = await asyncpg.connect(postgres_server.dsn)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def _script_october(nc: nats.NATS, tenant: str) -> dict[str, Alloc]:
    """A tenant's October 2026, every case in it. The seconds each allocation has in October, by hand:"""
    s = {name: Alloc(nc, tenant, gpus=g) for name, g in (("whole", 1), ("short", 2), ("from_sept", 4))}
    s |= {name: Alloc(nc, tenant, gpus=g) for name, g in (("into_nov", 8), ("forced", 2), ("running", 1))}
    s |= {name: Alloc(nc, tenant) for name in ("unsched", "failed_early", "released_early", "same_second")}
    s["baremetal"] = Alloc(nc, tenant, shape="baremetal", gpus=8)
    await s["whole"].up("2026-10-01 00:00:00", "2026-10-01 00:00:00.999")  # 10-01 00:00:00 -> 11-01 00:00:00
    await s["whole"].walk(("releasing", "2026-10-31 23:59:00"), ("released", "2026-11-01 00:00:00.5"))  # 31 days
    await s["short"].up("2026-10-02 10:00:00", "2026-10-02 10:00:10.5")  # 10:00:10 -> 10:15:10.2: 900 s
    await s["short"].walk(("releasing", "2026-10-02 10:15:00"), ("released", "2026-10-02 10:15:10.2"))
    await s["from_sept"].up("2026-09-30 23:00:00", "2026-09-30 23:59:59.5")  # Sept 23:59:59 -> Oct 01 01:00:00
    await s["from_sept"].walk(("releasing", "2026-10-01 00:59:00"), ("released", "2026-10-01 01:00:00"))  # 3600
    await s["into_nov"].up("2026-10-31 23:00:00", "2026-10-31 23:30:00")  # 1800 s of October
    await s["into_nov"].walk(("releasing", "2026-11-01 02:00:00"), ("released", "2026-11-01 02:30:00"))
    await s["forced"].up("2026-10-15 12:00:00", "2026-10-15 12:10:00")  # -> 13:10:00 forced: 3600 s
    await s["forced"].fail("2026-10-15 13:10:00", "force_released")
    await s["running"].up("2026-10-20 00:00:00", "2026-10-20 00:00:00")  # still active: 12 days to Nov 1
    await s["unsched"].walk(("accepted", "2026-10-03 00:00:00"), ("unschedulable", "2026-10-03 00:00:01"))
    await s["failed_early"].walk(("accepted", "2026-10-04 00:00:00"), ("placed", "2026-10-04 00:00:01"))
    await s["failed_early"].move("provisioning", "2026-10-04 00:00:02")
    await s["failed_early"].fail("2026-10-04 00:30:00")
    await s["released_early"].walk(("accepted", "2026-10-05 00:00:00"), ("placed", "2026-10-05 00:00:01"))
    await s["released_early"].walk(("releasing", "2026-10-05 00:00:02"), ("released", "2026-10-05 00:00:03"))
    await s["same_second"].up("2026-10-06 00:00:00", "2026-10-06 00:00:00.1")  # 0 s, still a record
    await s["same_second"].fail("2026-10-06 00:00:00.9", "task_deadline_passed")
    await s["baremetal"].up("2026-10-25 08:00:00", "2026-10-25 08:20:00")  # -> 10-26 08:20:00: 1 day
    await s["baremetal"].walk(("releasing", "2026-10-26 08:00:00"), ("released", "2026-10-26 08:20:00"))
    return s


OCTOBER = {
    "whole": 31 * DAY,
    "short": 900,
    "from_sept": 3600,
    "into_nov": 1800,
    "forced": 3600,
    "running": 12 * DAY,
    "same_second": 0,
    "baremetal": DAY,
}
GPUS = {"whole": 1, "short": 2, "from_sept": 4, "into_nov": 8, "forced": 2, "running": 1, "same_second": 2}


async def test_a_scripted_month_adds_up_exactly(nc, usage: Usage, http, spy, tmp_path) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    s = await _script_october(nc, tenant)
    other = Alloc(nc, f"other-{tenant}")
    await other.up("2026-10-01 00:00:00", "2026-10-01 00:00:00")  # another tenant's: not in the month's answer
    body = await month(http, usage, tenant, "2026-10")
    by_name = {name: records(body).get(str(a.id)) for name, a in s.items()}
    assert {n for n, r in by_name.items() if r is not None} == set(OCTOBER), "only what was active has a record"
    assert {n: r["seconds"] for n, r in by_name.items() if r} == OCTOBER
    gpus = {**GPUS, "baremetal": 8}
    assert {n: r["gpu_seconds"] for n, r in by_name.items() if r} == {n: OCTOBER[n] * gpus[n] for n in OCTOBER}
    assert by_name["running"]["open"] and by_name["running"]["stopped_at"] is None
    assert [r["open"] for r in body["items"]].count(True) == 1
    total = sum(OCTOBER.values())
    gpu_total = sum(OCTOBER[n] * gpus[n] for n in OCTOBER)
    assert body["totals"] == {"records": 8, "open": 1, "seconds": total, "gpu_seconds": gpu_total}
    assert total == 31 * DAY + 900 + 3600 + 1800 + 3600 + 12 * DAY + DAY
    assert [r["started_at"] for r in body["items"]] == sorted(r["started_at"] for r in body["items"])

    # Pages of two add up to the same, and a page's totals are the month's.
    seen, cursor = [], None
    while True:
        page = await month(
            http, usage, tenant, "2026-10", limit="2", as_of=body["as_of"], **({"cursor": cursor} if cursor else {})
        )
        assert len(page["items"]) <= 2 and page["totals"] == body["totals"]
        seen += page["items"]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == body["items"]

    # The neighbouring months hold the rest of the records that cross into them.
    sept = records(await month(http, usage, tenant, "2026-09"))
    assert {k: v["seconds"] for k, v in sept.items()} == {str(s["from_sept"].id): 1}
    nov = records(await month(http, usage, tenant, "2026-11"))
    assert nov[str(s["into_nov"].id)]["seconds"] == 9000 and str(s["running"].id) in nov

    # One usage.recorded for each record that closed; the running one has none yet.
    closed = [s[n].id for n in OCTOBER if n != "running"]
    events = await published(nc, spy, closed)
    assert {k: len(v) for k, v in events.items()} == {str(i): 1 for i in closed}
    assert not spy.of_type("usage.recorded", allocation_id=str(s["running"].id))
    assert events[str(s["short"].id)][0]["payload"]["seconds"] == 900

    # The export, as ops run it: csv, json and a table of the same records.
    def export(*fmt: str) -> Any:
        res = CliRunner().invoke(
            app,
            ["usage", "export", "--tenant", tenant, "--month", "2026-10", *fmt, "--run-dir", str(tmp_path)],
            env={"GPUAAS_OPS_ADMIN_URL": usage.view.url, "GPUAAS_BILLING_TOKEN": BILLING_TOKEN},
        )
        assert res.exit_code == 0, res.output
        return res.stdout

    rows = list(csv.DictReader(io.StringIO(await asyncio.to_thread(export, "-o", "csv"))))
    assert {r["allocation_id"]: int(r["seconds"]) for r in rows} == {str(s[n].id): OCTOBER[n] for n in OCTOBER}
    assert sum(int(r["seconds"]) for r in rows) == total
    assert sum(int(r["gpu_seconds"]) for r in rows) == gpu_total
    assert {r["open"] for r in rows} == {"True", "False"} and rows[0]["tenant_id"] == tenant
    doc = json.loads(await asyncio.to_thread(export, "-o", "json"))
    assert doc["totals"]["seconds"] == total and len(doc["items"]) == 8
    table = await asyncio.to_thread(export)
    assert str(s["whole"].id) in table and f"{total} s, {gpu_total} GPU-s" in table


async def test_bad_usage_queries_name_the_field(usage: Usage, http, tmp_path) -> None:
    for query, field in (
        ({}, "month"),
        ({"month": "2026-13"}, "month"),
        ({"month": "november"}, "month"),
        ({"month": "2026-11", "tenant": "no spaces"}, "tenant"),
        ({"month": "2026-11", "as_of": "2026-11-30T00:00:00"}, "as_of"),
        ({"month": "2026-11", "limit": "0"}, "limit"),
        ({"month": "2026-11", "cursor": "nope!"}, "cursor"),
    ):
        status, body = await get(http, f"{usage.view.url}/v1/usage", **query)
        assert status == 400, (query, body)
        assert body["error"]["code"] == "invalid_filter" and body["error"]["details"]["field"] == field, body
    async with aiohttp.ClientSession() as anonymous:
        async with anonymous.get(f"{usage.view.url}/v1/usage", params={"month": "2026-11"}) as resp:
            assert resp.status == 401

    def export(*argv: str, **env: str) -> Any:
        return CliRunner().invoke(app, ["usage", "export", *argv, "--run-dir", str(tmp_path)], env=env)

    res = await asyncio.to_thread(
        export, "--month", "2026-13", GPUAAS_OPS_ADMIN_URL=usage.view.url, GPUAAS_BILLING_TOKEN=BILLING_TOKEN
    )
    assert res.exit_code == 2 and "month" in res.stderr
    res = await asyncio.to_thread(
        export, "--month", "2026-11", GPUAAS_OPS_ADMIN_URL=usage.view.url, GPUAAS_BILLING_TOKEN="wrong"
    )
    assert res.exit_code == 3 and "refused by the ops API" in res.stderr
    res = await asyncio.to_thread(export, "--month", "2026-11")
    assert res.exit_code == 3 and "no ops API" in res.stderr
