"""The dev stack's MAAS simulator serves HTTPS from the stack's CA (issue 24, point 6), against the running stack:
the gateway runs pinned to that CA with no insecure setting and deploys a baremetal host through it (the
simulated host learns of its deploy over the same HTTPS), and a client without the CA is refused in the TLS
handshake, before the simulator reads a byte of its request."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from gpuaas_dev.stack import MAAS_SIM, Stack
from gpuaas_maas_gateway.adapters.maas_client import MaasClient
from gpuaas_maas_gateway.adapters.maas_errors import MaasUnreachable

from .conftest import maas_sim

pytestmark = pytest.mark.e2e


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def test_the_gateway_speaks_to_the_simulator_over_https_pinned_to_the_stacks_ca(portal, stack: Stack) -> None:
    described = json.loads(stack.description_file.read_text())
    ca = stack.maas_ca_file
    assert ca is not None and described["maas_ca_file"] == str(ca) == str(stack.run_dir / "tls" / "ca.pem")
    assert described["maas_url"] == stack.maas_url and stack.maas_url.startswith("https://127.0.0.1:")
    assert stack._get(MAAS_SIM).info["tls"] is True, "the simulator says it serves TLS"
    # What the running gateway process was started with: the stack's CA, and no permission for plain HTTP.
    gateway_pid = stack.pid("maas-gateway")
    assert gateway_pid is not None
    env = _environ(gateway_pid)
    assert env["GPUAAS_MAAS_URL"] == stack.maas_url and env["GPUAAS_MAAS_CA_FILE"] == str(ca)
    assert "GPUAAS_MAAS_INSECURE_HTTP" not in env

    alloc = await portal.request("baremetal", gpus=8)
    placed = await portal.wait_state(alloc, "placed")
    system_id = placed["payload"]["maas_system_id"]
    # Active: the gateway deployed through the simulator, and the simulated host, polling the simulator over the
    # same HTTPS, booted with the deploy's user-data and enrolled.
    await portal.wait_state(alloc, "active", timeout=90)
    calls = (await maas_sim(stack, "GET", "/_sim/calls"))["calls"]
    assert calls["deploy"][system_id] == 1
    await portal.release(alloc)
    await portal.wait_state(alloc, "released", timeout=90)

    log = stack.log_path("maas-gateway").read_text()
    assert '"maas_plain_http"' not in log and '"maas_tls_refused"' not in log
    assert '"sim_baremetal_maas_tls_refused"' not in stack.log_path("node-agent").read_text()


async def test_a_client_without_the_stacks_ca_is_refused_by_the_simulators_tls(stack: Stack) -> None:
    url = stack.maas_base_url
    # aiohttp with the system store.
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectorCertificateError) as caught:
            await http.get(f"{url}/_sim/healthz")
    assert "certificate verify failed" in str(caught.value.certificate_error)
    # urllib with its default context.
    with pytest.raises(urllib.error.URLError) as refused:
        await asyncio.to_thread(urllib.request.urlopen, f"{url}/_sim/healthz", timeout=5)
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError), refused.value
    assert "certificate verify failed" in str(refused.value.reason)
    # No plaintext fallback on the simulator's port.
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"{url.replace('https://', 'http://')}/_sim/healthz") as resp:
                await resp.read()

    # The gateway's own client, holding the MAAS key, with no CA pinned: the handshake fails and the simulator
    # never sees the deploy.
    machines = (await maas_sim(stack, "GET", "/_sim/machines"))["machines"]
    system_id = next(m["system_id"] for m in machines if m["status_name"] == "Ready")
    before = (await maas_sim(stack, "GET", "/_sim/calls"))["calls"].get("deploy", {}).get(system_id, 0)
    async with MaasClient(stack.maas_url, stack.maas_api_key, timeout=5.0) as client:
        with pytest.raises(MaasUnreachable, match="TLS refused") as unpinned:
            await client.deploy(system_id, distro_series="noble", user_data="#cloud-config\n")
    assert unpinned.value.outcome_unknown is False
    after = (await maas_sim(stack, "GET", "/_sim/calls"))["calls"].get("deploy", {}).get(system_id, 0)
    assert after == before
    assert (await maas_sim(stack, "GET", f"/_sim/machines/{system_id}"))["status_name"] == "Ready"
    # With the stack's CA, the same client is answered.
    async with MaasClient(stack.maas_url, stack.maas_api_key, timeout=5.0, ca_file=str(stack.maas_ca_file)) as client:
        assert {m.system_id for m in await client.list_machines()} >= {system_id}
