"""Machine operations: list (with MAAS filters), read, allocate, deploy, release, commission, abort."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ..config import RELEASE_FLAG_SETTINGS
from ..errors import BadRequest, NoMachineAvailable
from ..machines import Machine, NodeStatus
from ..power import after_deploy, after_release
from ..script_results import (
    BUILTIN_COMMISSIONING,
    HARDWARE_TYPES,
    PREFLIGHT_SCRIPT,
    RESULT_TYPES,
    preflight_output,
)
from ..state import API_ROOT, SimState
from ..wire import Params
from .routing import Call


def _status_from_filter(value: str) -> NodeStatus | None:
    for status in NodeStatus:
        if value.strip().lower() in (status.filter_name, status.label.lower(), str(int(status))):
            return status
    return None


def _machine_matches(machine: Machine, params: Params, state: SimState) -> bool:
    def any_of(key: str, actual: str | None) -> bool:
        wanted = params.getall(key)
        return not wanted or actual in wanted

    if not any_of("hostname", machine.hostname) and not any_of("hostname", machine.fqdn):
        return False
    checks = (
        ("id", machine.system_id),
        ("system_id", machine.system_id),
        ("agent_name", machine.agent_name),
        ("zone", machine.zone),
        ("pool", machine.pool),
        ("owner", machine.owner),
        ("mac_address", machine.mac_address),
    )
    if not all(any_of(key, actual) for key, actual in checks):
        return False
    statuses = params.getall("status")
    if statuses and machine.status not in {_status_from_filter(s) for s in statuses}:
        return False
    if not set(params.getall("tags")) <= machine.tags:
        return False
    return not set(params.getall("not_tags")) & machine.tags


def _check_tags_exist(state: SimState, params: Params, key: str = "tags") -> None:
    unknown = [t for t in params.getall(key) if t not in state.tags]
    if unknown:
        names = ", ".join(f"'{t}'" for t in unknown)
        raise BadRequest({key: [f"No such tag(s): {names}."]})


def list_machines(call: Call) -> Any:
    state = call.state
    _check_tags_exist(state, call.params)
    state.advance()
    return [m.to_json(API_ROOT) for m in state.machines.values() if _machine_matches(m, call.params, state)]


def read_machine(call: Call) -> Any:
    return call.machine.to_json(API_ROOT)


def allocate(call: Call) -> Any:
    state, params = call.state, call.params
    _check_tags_exist(state, params)
    state.advance()
    wanted_id = params.get("system_id")
    if wanted_id is not None:
        machine = state.machines.get(wanted_id)
        if machine is None or machine.status is not NodeStatus.READY or machine.owner is not None:
            raise NoMachineAvailable(f"No machine with system ID {wanted_id} available.")
        candidates = [machine]
    else:
        candidates = [
            m
            for m in sorted(state.machines.values(), key=lambda m: m.hostname)
            if m.status is NodeStatus.READY and m.owner is None and not m.locked
        ]
    name = params.get("name")
    zone, pool = params.get("zone"), params.get("pool")
    tags, not_tags = set(params.getall("tags")), set(params.getall("not_tags"))
    for machine in candidates:
        if name and name not in (machine.hostname, machine.fqdn):
            continue
        if (zone and zone != machine.zone) or (pool and pool != machine.pool):
            continue
        if not tags <= machine.tags or not_tags & machine.tags:
            continue
        machine.allocate(state.now(), state.config.owner, params.get("agent_name") or "", params.get("comment"))
        return machine.to_json(API_ROOT)
    if wanted_id is not None:
        raise NoMachineAvailable(f"No machine with system ID {wanted_id} available.")
    constraints = ", ".join(
        f"{k}={','.join(params.getall(k))}" for k in ("name", "tags", "not_tags", "zone", "pool") if params.getall(k)
    )
    raise NoMachineAvailable(f"No available machine matches constraints: {constraints or 'any'}")


def _resolve_distro(state: SimState, value: str | None) -> tuple[str, str]:
    config = state.config
    series = (value or "").strip() or config.default_distro_series
    osystem, _, name = series.rpartition("/")
    # Images named in the config count as uploaded; so does every complete uploaded boot resource.
    uploaded = set(config.custom_images or ()) | state.boot_resources.complete_names()
    if osystem == "custom":
        if config.custom_images is None or name in uploaded:
            return "custom", name
    elif osystem in ("", "ubuntu") and name in config.ubuntu_series:
        return "ubuntu", name
    elif osystem == "" and name in uploaded:
        return "custom", name
    choices = [f"ubuntu/{s}" for s in config.ubuntu_series]
    choices += [f"custom/{c}" for c in sorted(uploaded)]
    raise BadRequest(
        {
            "distro_series": [
                f"'{series}' is not a valid distro_series.  It should be one of: "
                + ", ".join(f"'{c}'" for c in ["", *choices])
                + "."
            ]
        }
    )


def _decode_user_data(value: str | None) -> bytes | None:
    if value is None or value == "":
        return None
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest({"user_data": ["User data must be base64 encoded."]}) from None


def deploy(call: Call) -> Any:
    state, params = call.state, call.params
    machine = call.machine
    osystem, series = _resolve_distro(state, params.get("distro_series"))
    user_data = _decode_user_data(params.get("user_data"))
    machine.deploy(
        state.now(),
        state.timers,
        owner=state.config.owner,
        osystem=osystem,
        distro_series=series,
        user_data=user_data,
        hwe_kernel=params.get("hwe_kernel") or None,
        agent_name=params.get("agent_name"),
        comment=params.get("comment"),
    )
    after_deploy(state, machine)
    return machine.to_json(API_ROOT)


def release(call: Call) -> Any:
    machine, params = call.machine, call.params
    # As MAAS: a flag the caller leaves out is the region's global setting for it.
    settings = call.state.config.erase_settings
    flags = {
        flag: params.flag(flag) if flag in params else settings[setting]
        for flag, setting in RELEASE_FLAG_SETTINGS.items()
    }
    machine.release(call.state.now(), call.state.timers, **flags, comment=params.get("comment"))
    if machine.erase_mode is not None and machine.status is NodeStatus.DISK_ERASING:
        _record_erase_run(call.state, machine)
    after_release(call.state, machine)
    return machine.to_json(API_ROOT)


# MAAS erases a released machine's disks with this builtin release script; its result set (type Release) says
# how the erase ended.
WIPE_DISKS_SCRIPT = "wipe-disks"
_ERASE_WORDS = {
    "secure": "secure erase (the drives' own)",
    "full": "full overwrite with zeros",
    "quick": "quick erase (2 MiB at each end)",
}


def _record_erase_run(state: SimState, machine: Machine) -> None:
    _settle(state, machine)  # an earlier erase's set ends before this one starts
    rset = state.results.new_set(machine.system_id, 3, state.config.wall_clock())
    machine.current_release_result_id = rset.id
    words = _ERASE_WORDS[machine.erase_mode or "full"]
    state.results.add(rset, WIPE_DISKS_SCRIPT, None, f"{WIPE_DISKS_SCRIPT} on {machine.hostname}: {words}\n")


# MAAS 3.x's layouts; `flat` is the one the host-image runbook deploys its tgz with.
STORAGE_LAYOUTS = ("flat", "lvm", "bcache", "vmfs6", "vmfs7", "custom", "blank")


def set_storage_layout(call: Call) -> Any:
    machine, params = call.machine, call.params
    layout = (params.get("storage_layout") or "").strip()
    if layout not in STORAGE_LAYOUTS:
        choices = ", ".join(f"'{name}'" for name in STORAGE_LAYOUTS)
        raise BadRequest(
            {
                "storage_layout": [f"Select a valid choice. {layout} is not one of the available choices."],
                "__all__": [f"Layouts: {choices}"],
            }
        )
    if machine.status not in (NodeStatus.READY, NodeStatus.ALLOCATED):
        raise BadRequest({"__all__": ["Cannot change the storage layout on a machine that is not Ready or Allocated."]})
    machine.storage_layout = layout
    return machine.to_json(API_ROOT)


def _script_names(call: Call, key: str) -> tuple[str, ...]:
    # MAAS takes a comma-separated list (and repeated keys, from other clients).
    names = tuple(n.strip() for v in call.params.getall(key) for n in v.split(",") if n.strip())
    unknown = [n for n in names if not call.state.scripts.known(n)]
    if unknown:
        raise BadRequest({key: [f"Unknown script name(s): {', '.join(unknown)}"]})
    return names


def commission(call: Call) -> Any:
    machine = call.machine
    scripts = _script_names(call, "commissioning_scripts")
    _script_names(call, "testing_scripts")
    machine.commission(call.state.now(), call.state.timers, scripts)
    _record_commissioning_run(call.state, machine, scripts)
    return machine.to_json(API_ROOT)


def _record_commissioning_run(state: SimState, machine: Machine, scripts: tuple[str, ...]) -> None:
    """The run's result set: builtins plus the uploaded commissioning scripts it runs (all when the
    request named none). A failing script fails commissioning, as MAAS does."""
    rset = state.results.new_set(machine.system_id, 0, state.config.wall_clock())
    machine.current_commissioning_result_id = rset.id
    uploaded = [
        s
        for s in state.scripts.scripts.values()
        if s.script_type == "commissioning" and (not scripts or s.name in scripts)
    ]
    for name in BUILTIN_COMMISSIONING:
        state.results.add(rset, name, None, f"{name} on {machine.hostname}\n")
    for script in uploaded:
        if script.name == PREFLIGHT_SCRIPT:
            out = machine.preflight_output
            if out is None:
                out = preflight_output(machine.hostname, machine.preflight_failures)
            exit_status = machine.preflight_exit_status
            if exit_status is None:
                exit_status = 1 if machine.preflight_failures else 0
            state.results.add(rset, script.name, script.id, out, exit_status)
            if exit_status != 0:
                machine.inject_failure("commissioning", f"Failed commissioning: {script.name} exited {exit_status}")
        else:
            state.results.add(rset, script.name, script.id, "")


def _current_ids(machine: Machine) -> dict[str, int | None]:
    return {
        "current-commissioning": machine.current_commissioning_result_id or None,
        "current-testing": None,
        "current-installation": None,
    }


def _settle(state: SimState, machine: Machine) -> None:
    """A set runs while its machine is still commissioning it, or still erasing for it (its wipe-disks result
    then takes the erase's exit status)."""
    for rset in state.results.for_node(machine.system_id):
        if not rset.running:
            continue
        if rset.result_type == 3:
            if rset.id == machine.current_release_result_id and machine.erase_exit_status is None:
                continue
            exit_status = machine.erase_exit_status if rset.id == machine.current_release_result_id else 1
            for result in rset.results:
                result.exit_status = exit_status if exit_status is not None else 1
        elif machine.status is NodeStatus.COMMISSIONING and machine.current_commissioning_result_id == rset.id:
            continue
        rset.running = False
        rset.ended = state.config.wall_clock()


def _output_params(call: Call) -> tuple[bool, tuple[str, ...]]:
    hardware = call.params.get("hardware_type")
    if hardware is not None and hardware.strip().lower() not in HARDWARE_TYPES:
        raise BadRequest({"hardware_type": [f"Unknown hardware type '{hardware}'"]})
    filters = tuple(f.strip() for v in call.params.getall("filters") for f in v.split(",") if f.strip())
    # Any value switches include_output on, "false" too (MAAS only looks for the key).
    return ("include_output" in call.params, filters)


def list_results(call: Call) -> Any:
    machine = call.machine
    _settle(call.state, machine)
    kind = call.params.get("type")
    wanted: int | None = None
    if kind is not None:
        if kind.strip().lower() not in RESULT_TYPES:
            raise BadRequest({"type": [f"Unknown type '{kind}'"]})
        wanted = RESULT_TYPES[kind.strip().lower()]
    include, filters = _output_params(call)
    sets = [s for s in call.state.results.for_node(machine.system_id) if wanted is None or s.result_type == wanted]
    return [s.to_json(API_ROOT, include, filters) for s in sorted(sets, key=lambda s: s.id)]


def read_result(call: Call) -> Any:
    machine = call.machine
    _settle(call.state, machine)
    rset = call.state.results.get(machine.system_id, call.path["id"], _current_ids(machine))
    include, filters = _output_params(call)
    return rset.to_json(API_ROOT, include, filters)


def abort(call: Call) -> Any:
    machine = call.machine
    machine.abort(call.state.now(), call.params.get("comment"))
    return machine.to_json(API_ROOT)
