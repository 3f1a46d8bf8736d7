"""Simulator controls under /_sim/: not part of MAAS, for tests and dev stacks. Unauthenticated but for the one
secret they could give away: a deploy's user-data (the host's bus creds and enrolment token), shown only to a
caller with the simulator's API key (`Authorization: Bearer <key>`), as real MAAS gives it only to the machine
through its own metadata token (`sim_user_data_headers`)."""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

from aiohttp import web

from .faults import Fault
from .state import SimState


def add_routes(app: web.Application, state_key: web.AppKey[SimState]) -> None:
    def state_of(request: web.Request) -> SimState:
        return request.app[state_key]

    async def healthz(request: web.Request) -> web.Response:
        state = state_of(request)
        return web.json_response({"ok": True, "machines": len(state.machines)})

    async def calls(request: web.Request) -> web.Response:
        state = state_of(request)
        responses = {op: {str(k): v for k, v in c.items()} for op, c in state.responses.items()}
        return web.json_response({"calls": state.calls_snapshot(), "responses": responses})

    async def reset_calls(request: web.Request) -> web.Response:
        state_of(request).calls.clear()
        state_of(request).responses.clear()
        return web.json_response({"calls": {}})

    async def list_faults(request: web.Request) -> web.Response:
        return web.json_response({"faults": [f.to_dict() for f in state_of(request).faults.list()]})

    async def add_faults(request: web.Request) -> web.Response:
        try:
            body: Any = await request.json()
            items = body.get("faults", [body]) if isinstance(body, dict) else list(body)
            faults = [Fault.from_dict(item) for item in items]
        except (ValueError, TypeError, AttributeError, KeyError) as error:
            return web.json_response({"error": str(error)}, status=400)
        state = state_of(request)
        unknown = [f.system_id for f in faults if f.system_id and f.system_id not in state.machines]
        if unknown:
            return web.json_response({"error": f"unknown system_id(s): {unknown}"}, status=400)
        for fault in faults:
            state.faults.add(fault)
        return web.json_response({"faults": [f.to_dict() for f in faults]})

    async def clear_faults(request: web.Request) -> web.Response:
        fault_id = request.query.get("id")
        state_of(request).faults.clear(int(fault_id) if fault_id else None)
        return web.json_response({"faults": [f.to_dict() for f in state_of(request).faults.list()]})

    def shown(request: web.Request, system_id: str) -> dict[str, Any]:
        state = state_of(request)
        data = state.machine_debug(system_id)
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {state.config.key}".encode()):
            return data
        last = (data.get("_sim") or {}).get("last_deploy")
        if last is not None and last.get("user_data") is not None:
            last.update(user_data=None, user_data_b64=None, user_data_withheld="needs the simulator's API key")
        return data

    async def machines(request: web.Request) -> web.Response:
        state = state_of(request)
        return web.json_response({"machines": [shown(request, sid) for sid in state.machines]})

    async def machine(request: web.Request) -> web.Response:
        state = state_of(request)
        system_id = request.match_info["system_id"]
        if system_id not in state.machines:
            return web.json_response({"error": f"no machine {system_id}"}, status=404)
        return web.json_response(shown(request, system_id))

    async def timers(request: web.Request) -> web.Response:
        state = state_of(request)
        if request.method == "POST":
            try:
                changes = await request.json()
                state.timers = state.timers.updated(**changes)
            except (ValueError, TypeError) as error:
                return web.json_response({"error": str(error)}, status=400)
        return web.json_response(dataclasses.asdict(state.timers))

    async def preflight(request: web.Request) -> web.Response:
        """What the slice firmware preflight prints on the machine's next commissioning runs:
        {"fail": {"kvm": "detail", …}} or {"output": "…", "exit_status": 0}; {} back to healthy."""
        state = state_of(request)
        system_id = request.match_info["system_id"]
        if system_id not in state.machines:
            return web.json_response({"error": f"no machine {system_id}"}, status=404)
        try:
            body: Any = await request.json()
            fail = body.get("fail") or {}
            if isinstance(fail, list):
                fail = {name: "" for name in fail}
            output, exit_status = body.get("output"), body.get("exit_status")
            if not isinstance(fail, dict) or (output is not None and not isinstance(output, str)):
                raise TypeError("fail must be a list or object, output a string")
        except (ValueError, TypeError, AttributeError) as error:
            return web.json_response({"error": str(error)}, status=400)
        machine = state.machines[system_id]
        machine.preflight_failures = {str(k): str(v) for k, v in fail.items()}
        machine.preflight_output = output
        machine.preflight_exit_status = int(exit_status) if exit_status is not None else None
        return web.json_response({"system_id": system_id, "fail": machine.preflight_failures})

    async def power(request: web.Request) -> web.Response:
        """Make a machine a VM behind the `virsh` power driver (virsh_power.py): {"power_parameters": {…},
        "ip_address": the address MAAS assigned it}. What an operator enters in MAAS for a virsh machine, plus
        the static address; the stack's lab uses it."""
        from .virsh_power import VirshParams

        state = state_of(request)
        system_id = request.match_info["system_id"]
        if system_id not in state.machines:
            return web.json_response({"error": f"no machine {system_id}"}, status=404)
        try:
            body: Any = await request.json()
            params = VirshParams.from_dict(dict(body["power_parameters"]))
            ip = body.get("ip_address")
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            return web.json_response({"error": str(error)}, status=400)
        machine = state.machines[system_id]
        if machine.owner is not None:
            return web.json_response({"error": f"{system_id} is in use ({machine.status.label})"}, status=409)
        machine.virsh, machine.power_type, machine.static_ip = params, "virsh", ip
        return web.json_response(state.machine_debug(system_id))

    app.router.add_post("/_sim/machines/{system_id}/preflight", preflight)
    app.router.add_put("/_sim/machines/{system_id}/power", power)
    app.router.add_get("/_sim/healthz", healthz)
    app.router.add_get("/_sim/calls", calls)
    app.router.add_delete("/_sim/calls", reset_calls)
    app.router.add_get("/_sim/faults", list_faults)
    app.router.add_post("/_sim/faults", add_faults)
    app.router.add_delete("/_sim/faults", clear_faults)
    app.router.add_get("/_sim/machines", machines)
    app.router.add_get("/_sim/machines/{system_id}", machine)
    app.router.add_get("/_sim/timers", timers)
    app.router.add_post("/_sim/timers", timers)


def sim_user_data_headers(api_key: str) -> dict[str, str]:
    """What a caller of /_sim/machines sends to see deploys' user-data."""
    return {"Authorization": f"Bearer {api_key}"}
