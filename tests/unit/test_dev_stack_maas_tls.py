"""What `gpuaas dev up` tells each process about the MAAS simulator (issue 24, point 6): HTTPS from the stack's CA
by default, the gateway and the simulated hosts pinned to that CA; plain HTTP only for a stack that names
`maas_insecure_http`, and then the gateway is told so by name. Made by the stack's own code, nothing started."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from gpuaas_dev.sim.settings import SimFleetSettings
from gpuaas_dev.stack import MAAS_SIM, Stack
from gpuaas_dev.stack.description import ADMIN_APIS
from gpuaas_dev.stack.environment import maas_sim_proc, service_proc
from gpuaas_maas_gateway.settings import GatewaySettings

PORT = 5240


def _stack(tmp_path: Path, **kwargs: object) -> Stack:
    """A stack as far as its processes' environment goes: the servers it would have started are stand-ins."""
    stack = Stack(tmp_path, **kwargs)  # type: ignore[arg-type]
    stack._nats = SimpleNamespace(url="tls://127.0.0.1:4222")  # type: ignore[assignment]
    stack._tls = SimpleNamespace(ca=tmp_path / "tls" / "ca.pem")  # type: ignore[assignment]
    stack._registry = SimpleNamespace(host="127.0.0.1:5000")  # type: ignore[assignment]
    stack._files = {k: tmp_path / k for k in ("fleet", "seed", "images", "machines")}
    stack._service_dsns = {s: "postgresql://x:x@127.0.0.1:5432/x" for s in ("maas-gateway",)}
    stack._maas_api_key, stack._enrolment_secret = "a:b:c", "e" * 32
    stack._admin_tokens = dict.fromkeys(ADMIN_APIS, "token")
    sim = maas_sim_proc(stack, PORT)
    sim.port = PORT
    stack._procs[MAAS_SIM] = sim
    return stack


def _gateway_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> GatewaySettings:
    # The suite names plain HTTP for its own simulators (tests/conftest.py); the stack's gateway gets only its env.
    monkeypatch.delenv("GPUAAS_MAAS_INSECURE_HTTP", raising=False)
    for key, value in env.items():
        if key.startswith("GPUAAS_"):
            monkeypatch.setenv(key, value)
    return GatewaySettings()  # type: ignore[call-arg]


def test_the_stack_serves_maas_over_https_and_its_clients_pin_the_stacks_ca(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = _stack(tmp_path)
    ca = tmp_path / "tls" / "ca.pem"
    assert stack.maas_ca_file == ca and stack.maas_url == f"https://127.0.0.1:{PORT}/MAAS/"

    sim = stack._procs[MAAS_SIM]
    tls = tmp_path / "tls"
    assert sim.argv[sim.argv.index("--tls-cert") + 1] == str(tls / "maas-sim.pem")
    assert sim.argv[sim.argv.index("--tls-key") + 1] == str(tls / "maas-sim-key.pem")
    assert sim.ready_ca == ca, "readiness is probed over https against the stack's CA"

    gateway = service_proc(stack, "maas-gateway").env
    assert gateway["GPUAAS_MAAS_URL"] == stack.maas_url and gateway["GPUAAS_MAAS_CA_FILE"] == str(ca)
    assert "GPUAAS_MAAS_INSECURE_HTTP" not in gateway
    settings = _gateway_settings(gateway, monkeypatch)
    assert (settings.maas_ca_file, settings.maas_insecure_http) == (str(ca), False)

    fleet = service_proc(stack, "node-agent").env
    assert fleet["GPUAAS_MAAS_SIM_URL"] == f"https://127.0.0.1:{PORT}"
    assert fleet["GPUAAS_MAAS_SIM_CA_FILE"] == str(ca)


def test_plain_http_only_for_a_stack_that_names_it_and_the_gateway_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = _stack(tmp_path, maas_insecure_http=True)
    assert stack.maas_ca_file is None and stack.maas_ssl_context is None
    assert stack.maas_url == f"http://127.0.0.1:{PORT}/MAAS/"
    sim = stack._procs[MAAS_SIM]
    assert "--tls-cert" not in sim.argv and sim.ready_ca is None
    gateway = service_proc(stack, "maas-gateway").env
    assert gateway["GPUAAS_MAAS_INSECURE_HTTP"] == "true" and "GPUAAS_MAAS_CA_FILE" not in gateway
    assert _gateway_settings(gateway, monkeypatch).maas_insecure_http is True
    assert "GPUAAS_MAAS_SIM_CA_FILE" not in service_proc(stack, "node-agent").env


def test_the_simulated_hosts_refuse_an_https_simulator_without_its_ca(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs the CA"):
        SimFleetSettings(fleet_file="fleet.json", maas_sim_url="https://127.0.0.1:5240")
    pinned = SimFleetSettings(fleet_file="fleet.json", maas_sim_url="https://127.0.0.1:5240", maas_sim_ca_file="ca.pem")
    assert pinned.maas_sim_ca_file == "ca.pem"
