"""The gateway's MAAS client against the simulator: results, every fault class, and key secrecy."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import structlog

from gpuaas_dev.maas_sim import SimConfig, start, system_id_for
from gpuaas_dev.maas_sim.control import sim_user_data_headers
from gpuaas_dev.testing.waiting import eventually
from gpuaas_maas_gateway.adapters.maas_client import MaasClient
from gpuaas_maas_gateway.adapters.maas_errors import (
    MaasAuthError,
    MaasBadRequest,
    MaasConflict,
    MaasError,
    MaasGatewayTimeout,
    MaasNoResponse,
    MaasNotFound,
    MaasServerError,
    MaasUnavailable,
)
from gpuaas_maas_gateway.adapters.maas_models import MachineStatus

KEY = "Ck7sQ2mZp9LxVb3Nq4:Tk8wR1nYc6HjDf2Gs5:Sx3vB9mQ7pL2kJ8hG4fD1sA6zX0cV5bN"
KEY_PARTS = KEY.split(":")
BM01 = system_id_for("bm-01")
BM02 = system_id_for("bm-02")


class Sim:
    def __init__(self, port: int, http: aiohttp.ClientSession) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.url = f"{self.base}/MAAS/"
        self.http = http

    async def fault(self, **fault: Any) -> None:
        async with self.http.post(f"{self.base}/_sim/faults", json=fault) as r:
            assert r.status == 200, await r.text()

    async def machine(self, system_id: str) -> dict[str, Any]:
        async with self.http.get(f"{self.base}/_sim/machines/{system_id}", headers=sim_user_data_headers(KEY)) as r:
            return await r.json()

    async def calls(self) -> dict[str, dict[str, int]]:
        async with self.http.get(f"{self.base}/_sim/calls") as r:
            return (await r.json())["calls"]


@pytest_asyncio.fixture
async def sim() -> AsyncIterator[Sim]:
    config = SimConfig(machines=3, api_key=KEY)
    config.timers = config.timers.updated(
        deploying=0.2, releasing=0.1, disk_erasing=0.1, commissioning=0.1, testing=0.1
    )
    runner, port = await start(config)
    try:
        async with aiohttp.ClientSession() as http:
            yield Sim(port, http)
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture
async def client(sim: Sim) -> AsyncIterator[MaasClient]:
    async with MaasClient(sim.url, KEY, timeout=5.0) as c:
        yield c


async def wait_status(client: MaasClient, system_id: str, status: MachineStatus) -> None:
    async def reached() -> bool:
        return (await client.read_machine(system_id)).status is status

    await eventually(reached)


# ---- happy path -------------------------------------------------------------------------------------


async def test_happy_path_allocate_deploy_release_commission(sim: Sim, client: MaasClient) -> None:
    assert (await client.version())["version"]
    machines = await client.list_machines()
    assert [m.hostname for m in machines] == ["bm-01", "bm-02", "bm-03"]
    assert [m.hostname for m in await client.list_machines(hostname=["bm-02", "bm-03"])] == ["bm-02", "bm-03"]

    allocated = await client.allocate(system_id=BM01, agent_name="alloc-42", comment="test")
    assert allocated.status is MachineStatus.ALLOCATED
    assert [m.system_id for m in await client.list_machines(agent_name="alloc-42")] == [BM01]

    deploying = await client.deploy(
        BM01,
        "custom/gpuaas-h200-host-ubuntu2404",
        user_data=b"#cloud-config\nhostname: x\n",
        agent_name="alloc-42",
    )
    assert deploying.status is MachineStatus.DEPLOYING
    assert (deploying.osystem, deploying.distro_series) == ("custom", "gpuaas-h200-host-ubuntu2404")
    last = (await sim.machine(BM01))["_sim"]["last_deploy"]
    assert last["user_data"] == "#cloud-config\nhostname: x\n"
    await wait_status(client, BM01, MachineStatus.DEPLOYED)
    assert [m.hostname for m in await client.list_machines(status="deployed")] == ["bm-01"]

    released = await client.release(BM01, erase=True, quick_erase=True)
    assert released.status is MachineStatus.DISK_ERASING
    await wait_status(client, BM01, MachineStatus.READY)
    assert (await client.read_machine(BM01)).owner is None

    commissioning = await client.commission(BM01, commissioning_scripts=["update_firmware"])
    assert commissioning.status is MachineStatus.COMMISSIONING
    await wait_status(client, BM01, MachineStatus.READY)

    await sim.http.post(f"{sim.base}/_sim/timers", json={"deploying": 60})
    await client.deploy(BM02, "noble")
    aborted = await client.abort(BM02, comment="changed my mind")
    assert aborted.status is MachineStatus.ALLOCATED


# ---- definite errors --------------------------------------------------------------------------------


async def test_definite_errors_are_not_unknown(sim: Sim, client: MaasClient) -> None:
    with pytest.raises(MaasNotFound) as nf:
        await client.read_machine("zzzzzz")
    assert nf.value.body == "No Machine matches the given query."

    with pytest.raises(MaasBadRequest) as bad:
        await client.deploy(BM01, "plan9")
    assert bad.value.outcome_unknown is False
    assert "distro_series" in bad.value.json

    await client.deploy(BM01, "noble")
    with pytest.raises(MaasConflict) as conflict:
        await client.deploy(BM01, "noble")
    assert conflict.value.outcome_unknown is False
    assert conflict.value.retry_after is None
    assert conflict.value.body == "Can't deploy a machine that is in the 'Deploying' state"

    with pytest.raises(MaasConflict) as none_left:
        await client.allocate(system_id=BM01)
    assert none_left.value.body == f"No machine with system ID {BM01} available."

    with pytest.raises(MaasBadRequest) as commission:
        await client.commission(BM01)
    assert commission.value.json == {
        "__all__": ["Commission is not available because of the current state of the node."]
    }

    async with MaasClient(sim.url, "wrongconsumerkey00:" + KEY_PARTS[1] + ":" + KEY_PARTS[2]) as bad_key:
        with pytest.raises(MaasAuthError) as auth:
            await bad_key.list_machines()
    assert auth.value.outcome_unknown is False
    assert auth.value.body == "Authorization Error: Invalid API key."


# ---- injected faults --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,exc,unknown,retry_after,committed",
    [
        ("conflict", MaasConflict, False, 5.0, False),
        ("unavailable", MaasUnavailable, True, 10.0, True),
        ("gateway_timeout", MaasGatewayTimeout, True, None, True),
        ("server_error", MaasServerError, True, None, True),
    ],
)
async def test_fault_maps_to_exception_and_outcome(
    sim: Sim,
    client: MaasClient,
    kind: str,
    exc: type[MaasError],
    unknown: bool,
    retry_after: float | None,
    committed: bool,
) -> None:
    await sim.fault(op="deploy", system_id=BM01, kind=kind, count=1)
    with pytest.raises(exc) as err:
        await client.deploy(BM01, "noble")
    assert err.value.outcome_unknown is unknown
    assert err.value.retry_after == retry_after
    if kind == "conflict":
        assert "<html>" in err.value.body
    # The state proves what happened: MAAS commits before the post-commit hook fails.
    status = (await client.read_machine(BM01)).status
    assert status is (MachineStatus.DEPLOYING if committed else MachineStatus.READY)
    # count=1: the next call is clean.
    if not committed:
        assert (await client.deploy(BM01, "noble")).status is MachineStatus.DEPLOYING


async def test_5xx_on_a_read_is_not_an_unknown_outcome(sim: Sim, client: MaasClient) -> None:
    await sim.fault(op="read", kind="unavailable", count=1)
    with pytest.raises(MaasUnavailable) as err:
        await client.read_machine(BM01)
    assert err.value.outcome_unknown is False


async def test_response_lost_after_commit(sim: Sim) -> None:
    # Deploying must outlast the client timeout for the committed state to be observed.
    await sim.http.post(f"{sim.base}/_sim/timers", json={"deploying": 30})
    await sim.fault(op="deploy", system_id=BM01, kind="lost_after_commit", count=1)
    async with MaasClient(sim.url, KEY, timeout=0.5) as client:
        with pytest.raises(MaasNoResponse) as err:
            await client.deploy(BM01, "noble", user_data="#!/bin/sh\n")
        assert err.value.outcome_unknown is True
        assert err.value.status is None
        machine = await sim.machine(BM01)
        assert machine["status_name"] == "Deploying"
        assert (await sim.calls())["deploy"] == {BM01: 1}
        # Resolving by observation: a repeated deploy would be refused anyway.
        with pytest.raises(MaasConflict):
            await client.deploy(BM01, "noble")


async def test_connection_dropped_after_commit(sim: Sim, client: MaasClient) -> None:
    await client.allocate(system_id=BM02)
    await sim.fault(op="release", system_id=BM02, kind="lost_after_commit", mode="close", count=1)
    with pytest.raises(MaasNoResponse) as err:
        await client.release(BM02)
    assert err.value.outcome_unknown is True
    assert (await sim.machine(BM02))["status_name"] in ("Releasing", "Ready")
    # Release is idempotent on Releasing/Ready, so retrying it is safe.
    await client.release(BM02)


async def test_latency_within_and_beyond_the_client_timeout(sim: Sim) -> None:
    await sim.fault(op="list", kind="latency", latency=0.05, count=1)
    await sim.fault(op="read", kind="latency", latency=2.0, count=1)
    async with MaasClient(sim.url, KEY, timeout=0.5) as client:
        assert len(await client.list_machines()) == 3
        with pytest.raises(MaasNoResponse) as err:
            await client.read_machine(BM01)
        assert err.value.outcome_unknown is False  # a read has no outcome to lose


async def test_deploy_can_end_in_failed_deployment(sim: Sim, client: MaasClient) -> None:
    await sim.fault(
        op="deploy",
        system_id=BM01,
        kind="failed_deployment",
        status_message="Failed deployment: curtin exited 3",
        count=1,
    )
    assert (await client.deploy(BM01, "noble")).status is MachineStatus.DEPLOYING
    await wait_status(client, BM01, MachineStatus.FAILED_DEPLOYMENT)
    machine = await client.read_machine(BM01)
    assert machine.status_message == "Failed deployment: curtin exited 3"


async def test_probabilistic_faults_are_seeded(sim: Sim, client: MaasClient) -> None:
    await sim.fault(op="list", kind="server_error", probability=0.5)
    outcomes = []
    for _ in range(20):
        try:
            await client.list_machines()
            outcomes.append(True)
        except MaasServerError:
            outcomes.append(False)
    assert 0 < outcomes.count(False) < 20


async def test_unreachable_maas_means_nothing_was_sent() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with MaasClient(f"http://127.0.0.1:{port}/MAAS/", KEY, timeout=2.0) as client:
        with pytest.raises(MaasNoResponse) as err:
            await client.deploy(BM01, "noble")
    assert err.value.outcome_unknown is False


# ---- secrecy ----------------------------------------------------------------------------------------


async def test_api_key_never_leaks(sim: Sim, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    wrong_token = f"{KEY_PARTS[0]}:wrongtokenkey00000:{KEY_PARTS[2]}"
    await sim.fault(op="deploy", kind="lost_after_commit", count=1)
    await sim.fault(op="release", kind="gateway_timeout", count=1)
    with structlog.testing.capture_logs() as captured:
        async with MaasClient(sim.url, KEY, timeout=0.5) as client:
            texts += [repr(client), str(client)]
            await client.list_machines()
            for call in (
                client.deploy(BM01, "noble", user_data=b"x"),
                client.release(BM01),
                client.read_machine("zzzzzz"),
            ):
                with pytest.raises(MaasError) as err:
                    await call
                texts += [str(err.value), repr(err.value), err.value.body]
        async with MaasClient(sim.url, wrong_token) as bad:
            with pytest.raises(MaasAuthError) as err:
                await bad.list_machines()
            texts += [str(err.value), repr(err.value), err.value.body, repr(bad)]
    with pytest.raises(ValueError) as malformed:
        MaasClient(sim.url, "only-one-part-" + KEY_PARTS[2])
    texts.append(str(malformed.value))

    assert captured, "the client logs its calls"
    everything = "\n".join(texts + [repr(e) for e in captured] + [caplog.text])
    assert "**redacted**" in everything  # the 401 echoed the token and was scrubbed
    for secret in (KEY, *KEY_PARTS, "wrongtokenkey00000"):
        assert secret not in everything


# ---- commissioning script results ------------------------------------------------------------------

PREFLIGHT = "50-gpuaas-slice-firmware-preflight"


async def _commission_with_preflight(client: MaasClient, system_id: str, expect: MachineStatus) -> int:
    try:
        await client.read_script(PREFLIGHT)
    except MaasNotFound:
        await client.create_script(PREFLIGHT, "#!/bin/bash\necho GPUAAS_SLICE_PREFLIGHT\n")
    await client.commission(system_id, commissioning_scripts=[PREFLIGHT])
    await wait_status(client, system_id, expect)
    return (await client.read_machine(system_id)).raw["current_commissioning_result_id"]


async def test_script_results_fetched_as_maas_serves_them_and_judged(sim: Sim, client: MaasClient) -> None:
    from gpuaas_maas_gateway.adapters.maas_client import decode_output
    from gpuaas_maas_gateway.domain import slice_preflight as pre

    set_id = await _commission_with_preflight(client, BM01, MachineStatus.READY)
    sets = await client.list_results(BM01, filters=[PREFLIGHT])
    assert [s["id"] for s in sets] == [set_id] and sets[0]["type_name"] == "Commissioning"
    assert sets[0]["resource_uri"] == f"/MAAS/api/2.0/nodes/{BM01}/results/{set_id}/"
    (result,) = sets[0]["results"]
    assert (result["name"], result["status_name"], result["exit_status"]) == (PREFLIGHT, "Passed", 0)
    text = decode_output(result, "stdout")
    assert text is not None and "GPUAAS_SLICE_PREFLIGHT_SUMMARY failures=0" in text
    assert decode_output(result, "output") == text
    assert pre.verdict(pre.parse(text), script_status="Passed", exit_status=0).status == "passed"
    # Without include_output no output keys; the whole set lists the builtins too, sorted by name.
    bare = await client.list_results(BM01, include_output=False)
    names = [r["name"] for r in bare[0]["results"]]
    assert names == sorted(names) and PREFLIGHT in names and "stdout" not in bare[0]["results"][0]
    current = await client.read_result(BM01, "current-commissioning", filters=[PREFLIGHT])
    assert current["id"] == set_id
    with pytest.raises(MaasBadRequest) as bad:
        await client.read_result(BM01, "current-testing")
    assert 'Unknown id "current-testing"' in bad.value.body
    with pytest.raises(MaasNotFound):
        await client.read_result(BM01, 999)
    with pytest.raises(MaasBadRequest):
        await client.list_results(BM01, result_type="bogus")

    # A host whose preflight fails: the script exits 1, MAAS fails commissioning, the output says why.
    r = await sim.http.post(f"{sim.base}/_sim/machines/{BM02}/preflight", json={"fail": {"kvm": "kvm=missing"}})
    assert r.status == 200
    failed_id = await _commission_with_preflight(client, BM02, MachineStatus.FAILED_COMMISSIONING)
    (failed,) = (await client.read_result(BM02, failed_id, filters=[PREFLIGHT]))["results"]
    assert (failed["status_name"], failed["exit_status"]) == ("Failed", 1)
    judged = pre.verdict(pre.parse(decode_output(failed) or ""), script_status="Failed", exit_status=1)
    assert judged.status == "failed" and any(x.startswith("kvm: kvm=missing") for x in judged.reasons)
