"""One embedded stack (real NATS, Postgres, five service processes, MAAS simulator, simulated
fleet) shared by the e2e tests of a module, plus helpers that speak to it like a portal would."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import nats
import pytest

from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_dev.maas_sim.control import sim_user_data_headers
from gpuaas_dev.stack import Stack
from gpuaas_dev.testing.bus_spy import BusSpy
from gpuaas_dev.testing.databases import ServiceDatabases
from gpuaas_dev.testing.servers import NatsServer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Non-durable Postgres on purpose: these tests check behaviour, not crash safety, and a commit costs
    # several times less without fsync (`make run` and the benchmarks stay durable).
    s = Stack(
        tmp_path_factory.mktemp("stack"), slice_hosts=2, slots_per_host=8, baremetal_hosts=2, unsafe_no_fsync=True
    )
    s.start()
    yield s
    s.stop()


class Portal:
    """Publishes portal input and follows the lifecycle, validating every message it sees."""

    def __init__(self, stack: Stack, spy: BusSpy, nc: Any) -> None:
        self.stack = stack
        self.spy = spy
        self.nc = nc
        self.js = nc.jetstream()

    async def publish(
        self, type_: str, payload: m.Payload | dict[str, Any], *, msg_id: str | None = None, event_id: str | None = None
    ) -> Envelope:
        body = payload if isinstance(payload, dict) else payload.model_dump(mode="json")
        env = Envelope.wrap(
            type_, body, producer="portal", correlation_id=str(body.get("allocation_id", "x")), event_id=event_id
        )
        subject = (
            "gpuaas.allocation.requested" if type_ == "allocation.requested" else "gpuaas.allocation.release_requested"
        )
        await self.js.publish(subject, env.model_dump_json().encode(), headers={"Nats-Msg-Id": msg_id or env.event_id})
        return env

    async def publish_raw(self, body: bytes) -> None:
        self.spy.allow_invalid(body)
        await self.js.publish("gpuaas.allocation.requested", body)

    async def request(self, shape: str = "gpu_slice", gpus: int = 1, **overrides: Any) -> uuid.UUID:
        alloc = overrides.pop("allocation_id", uuid.uuid4())
        defaults = {
            "gpu_slice": {"sku": "h200-sxm-slice", "image": "ubuntu-24.04-h200-slice"},
            "baremetal": {"sku": "h200-sxm", "image": "ubuntu-24.04-h200-host"},
        }[shape]
        payload = {
            "allocation_id": str(alloc),
            "tenant_id": "tenant-a",
            "shape": shape,
            "gpu_count": gpus,
            "ssh_public_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDev tenant@example"],
            **defaults,
            **overrides,
        }
        await self.publish("allocation.requested", payload)
        return alloc

    async def release(self, alloc: uuid.UUID) -> None:
        await self.publish("allocation.release_requested", m.AllocationReleaseRequested(allocation_id=alloc))

    async def wait_state(self, alloc: uuid.UUID, state: str, timeout: float = 60.0) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            events = self.spy.of_type(f"allocation.{state}", allocation_id=alloc)
            if events:
                return events[0]
            dead_ends = ("failed", "unschedulable") + (("released",) if state != "released" else ())
            if not self.spy.of_type("allocation.accepted", allocation_id=alloc):
                # A rejection after acceptance is a refused duplicate, not the fate of this allocation.
                dead_ends += ("rejected",)
            for terminal in dead_ends:
                if terminal != state and self.spy.of_type(f"allocation.{terminal}", allocation_id=alloc):
                    bad = self.spy.of_type(f"allocation.{terminal}", allocation_id=alloc)[0]
                    raise AssertionError(f"{alloc} ended {terminal} while waiting for {state}: {bad['payload']}")
            return None

        return await self.spy.wait_for(found, timeout, f"{alloc} {state}")


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A bare nats-server for the lab tests that drive one agent without the stack."""
    server = NatsServer(tmp_path_factory.mktemp("lab-nats")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def portal(stack: Stack) -> AsyncIterator[Portal]:
    # The tests watch everything and inject hostile input, so they act as the break-glass admin; the
    # services and hosts under test run as their own least-privilege identities.
    spy = await BusSpy(stack.nats_url, connect=stack.nats_options("admin")).start()
    nc = await nats.connect(**stack.nats_options("admin"))
    yield Portal(stack, spy, nc)
    await nc.drain()
    await spy.stop()
    assert spy.violations == [], f"messages broke the contract: {spy.violations[:5]}"


@pytest.fixture(scope="module")
async def db(stack: Stack) -> AsyncIterator[ServiceDatabases]:
    # Each statement runs on the database of the service whose schema it names (`scheduler.nodes`).
    dbs = await stack.open_databases()
    yield dbs
    await dbs.close()


async def maas_sim(stack: Stack, method: str, path: str, body: Any = None) -> Any:
    """The simulator's `/_sim/` controls, over HTTPS verified against the stack's CA alone, with its key (deploys'
    user-data shown)."""
    async with aiohttp.ClientSession(headers=sim_user_data_headers(stack.maas_api_key)) as http:
        tls = stack.maas_ssl_context or True
        async with http.request(method, f"{stack.maas_base_url}{path}", json=body, ssl=tls) as resp:
            text = await resp.text()
            assert resp.status < 400, text
            return json.loads(text)


async def scheduler_admin(
    stack: Stack, method: str, path: str, body: Any = None, actor: str = "ops"
) -> tuple[int, Any]:
    """The scheduler's admin API as ops call it (a write carries an idempotency key and the actor): status, body."""
    headers = {"Authorization": f"Bearer {stack.scheduler_admin_token}"}
    if method != "GET":
        headers |= {"Idempotency-Key": uuid.uuid4().hex, "X-Actor": actor}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, stack.scheduler_admin_url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json()


async def scheduler_ok(stack: Stack, method: str, path: str, body: Any = None) -> Any:
    """`scheduler_admin` that must answer 200: its body."""
    status, answer = await scheduler_admin(stack, method, path, body)
    assert status == 200, answer
    return answer
