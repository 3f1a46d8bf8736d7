"""MAAS API operations of the simulator and the handler table that routes and describes them.

Operations are synchronous: each one is a single "transaction" against `SimState`. Faults,
latency and call counting wrap them in `app.py`, which is what lets a fault answer *after* the
state change was committed, the way MAAS does when a post-commit power RPC fails.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .describe import ActionSpec, HandlerSpec
from .errors import BadRequest, NoMachineAvailable, NotFound
from .machines import Machine, NodeStatus
from .state import API_ROOT, SimState
from .wire import Params

TAG_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")


@dataclass(frozen=True)
class Call:
    state: SimState
    params: Params
    path: dict[str, str]

    @property
    def machine(self) -> Machine:
        return self.state.machine(self.path["system_id"])


OpFn = Callable[[Call], Any]


@dataclass(frozen=True)
class Operation:
    name: str  # the name calls are counted and faults are matched under
    method: str
    op: str | None
    fn: OpFn
    mutation: bool
    doc: str = ""

    @property
    def action_name(self) -> str:
        if self.op is not None:
            return self.op
        return {"GET": "read", "POST": "create", "PUT": "update", "DELETE": "delete"}[self.method]


@dataclass(frozen=True)
class Route:
    handler: str
    path: str
    operations: tuple[Operation, ...]
    anon: bool = False
    doc: str = ""

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)\}", self.path))

    @property
    def pattern(self) -> re.Pattern[str]:
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.path)
        return re.compile(f"^{regex}$")

    def find(self, method: str, op: str | None) -> Operation | None:
        for operation in self.operations:
            if operation.method == method and operation.op == op:
                return operation
        return None

    def spec(self) -> HandlerSpec:
        return HandlerSpec(
            name=self.handler,
            path=self.path,
            params=self.params,
            anon=self.anon,
            doc=self.doc,
            actions=tuple(ActionSpec(o.action_name, o.method, o.op, o.doc) for o in self.operations),
        )


# ---- machines ------------------------------------------------------------------------------------


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
    return machine.to_json(API_ROOT)


def release(call: Call) -> Any:
    machine, params = call.machine, call.params
    machine.release(
        call.state.now(),
        call.state.timers,
        erase=params.flag("erase"),
        quick_erase=params.flag("quick_erase"),
        secure_erase=params.flag("secure_erase"),
        comment=params.get("comment"),
    )
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
    return machine.to_json(API_ROOT)


def abort(call: Call) -> Any:
    machine = call.machine
    machine.abort(call.state.now(), call.params.get("comment"))
    return machine.to_json(API_ROOT)


# ---- tags ----------------------------------------------------------------------------------------


def _tag(call: Call) -> dict[str, Any]:
    tag = call.state.tags.get(call.path["name"])
    if tag is None:
        raise NotFound("No Tag matches the given query.")
    return tag


def list_tags(call: Call) -> Any:
    return list(call.state.tags.values())


def create_tag(call: Call) -> Any:
    params = call.params
    name = params.get("name") or ""
    if not name:
        raise BadRequest({"name": ["This field is required."]})
    if not TAG_NAME.match(name):
        raise BadRequest({"name": ["Invalid character in the tag name."]})
    if name in call.state.tags:
        raise BadRequest({"name": ["Tag with this Name already exists."]})
    return call.state.ensure_tag(
        name,
        definition=params.get("definition") or "",
        comment=params.get("comment") or "",
        kernel_opts=params.get("kernel_opts") or "",
    )


def read_tag(call: Call) -> Any:
    return _tag(call)


def tag_machines(call: Call) -> Any:
    name = _tag(call)["name"]
    call.state.advance()
    return [m.to_json(API_ROOT) for m in call.state.machines.values() if name in m.tags]


def update_tag_nodes(call: Call) -> Any:
    name = _tag(call)["name"]
    added = removed = 0
    for system_id in call.params.getall("add"):
        machine = call.state.machines.get(system_id)
        if machine is not None and name not in machine.tags:
            machine.tags.add(name)
            added += 1
    for system_id in call.params.getall("remove"):
        machine = call.state.machines.get(system_id)
        if machine is not None and name in machine.tags:
            machine.tags.discard(name)
            removed += 1
    return {"added": added, "removed": removed}


# ---- boot resources and scripts --------------------------------------------------------------------


def list_boot_resources(call: Call) -> Any:
    wanted = call.params.get("type")
    resources = call.state.boot_resources.resources.values()
    if wanted not in (None, "", "uploaded"):
        resources = []  # only uploaded resources are simulated; synced ones are never present
    return [r.to_json(API_ROOT, with_sets=False) for r in resources]


def create_boot_resource(call: Call) -> Any:
    params = call.params
    content = params.files.get("content")
    if content is None and "content" in params:
        content = (params.get("content") or "").encode("utf-8")
    resource = call.state.boot_resources.create(
        name=params.get("name") or "",
        architecture=params.get("architecture") or "",
        title=params.get("title") or "",
        filetype=(params.get("filetype") or "tgz").lower(),
        base_image=params.get("base_image") or "",
        content=content,
        sha256=params.get("sha256"),
        size=params.get("size"),
    )
    return Created(resource.to_json(API_ROOT, with_sets=True))


def read_boot_resource(call: Call) -> Any:
    return call.state.boot_resources.get(call.path["id"]).to_json(API_ROOT, with_sets=True)


def delete_boot_resource(call: Call) -> Any:
    call.state.boot_resources.delete(call.path["id"])
    return NoContent()


def upload_boot_resource_file(call: Call) -> Any:
    call.state.boot_resources.upload(call.path["id"], call.path["file_id"], call.params.body)
    return "OK"


def list_scripts(call: Call) -> Any:
    kind = call.params.get("type")
    return [s.to_json(API_ROOT) for s in call.state.scripts.scripts.values() if kind is None or s.script_type == kind]


def create_script(call: Call) -> Any:
    params = call.params
    body = params.files.get("script")
    script = body.decode("utf-8", errors="replace") if body is not None else params.get("script")
    return call.state.scripts.create(
        name=params.get("name") or "",
        script=script,
        script_type=params.get("type"),
        title=params.get("title") or "",
        description=params.get("description") or "",
        tags=tuple(t for v in params.getall("tags") for t in v.split(",") if t),
        timeout=params.get("timeout"),
    ).to_json(API_ROOT)


def read_script(call: Call) -> Any:
    return call.state.scripts.get(call.path["name"]).to_json(API_ROOT)


@dataclass(frozen=True)
class Created:
    """A 201 answer (MAAS creates boot resources with 201, most other things with 200)."""

    data: Any


@dataclass(frozen=True)
class NoContent:
    """A 204 answer."""


# ---- anonymous -----------------------------------------------------------------------------------


def version(call: Call) -> Any:
    return {
        "capabilities": [
            "networks-management",
            "static-ipaddresses",
            "ipv6-deployment-ubuntu",
            "devices-management",
            "storage-deployment-ubuntu",
            "network-deployment-ubuntu",
            "bridging-interface-ubuntu",
            "bridging-automatic-ubuntu",
            "authenticate-api",
        ],
        "version": call.state.config.maas_version,
        "subversion": "",
    }


ROUTES: tuple[Route, ...] = (
    Route(
        "VersionHandler",
        "version/",
        (Operation("version", "GET", None, version, False, "Version and capabilities of MAAS."),),
        anon=True,
        doc="Information about this MAAS instance.",
    ),
    Route(
        "MachinesHandler",
        "machines/",
        (
            Operation("list", "GET", None, list_machines, False, "List machines, optionally filtered."),
            Operation("allocate", "POST", "allocate", allocate, True, "Allocate a Ready machine."),
        ),
        doc="Manage the collection of all machines in MAAS.",
    ),
    Route(
        "MachineHandler",
        "machines/{system_id}/",
        (
            Operation("read", "GET", None, read_machine, False, "Read a machine."),
            Operation("deploy", "POST", "deploy", deploy, True, "Deploy an OS to a machine."),
            Operation("release", "POST", "release", release, True, "Release a machine."),
            Operation("commission", "POST", "commission", commission, True, "Commission a machine."),
            Operation("abort", "POST", "abort", abort, True, "Abort the machine's current action."),
        ),
        doc="Manage an individual machine.",
    ),
    Route(
        "TagsHandler",
        "tags/",
        (
            Operation("tags.list", "GET", None, list_tags, False, "List tags."),
            Operation("tags.create", "POST", None, create_tag, True, "Create a tag."),
        ),
        doc="Manage all tags known to MAAS.",
    ),
    Route(
        "TagHandler",
        "tags/{name}/",
        (
            Operation("tag.read", "GET", None, read_tag, False, "Read a tag."),
            Operation("tag.machines", "GET", "machines", tag_machines, False, "Machines with this tag."),
            Operation(
                "tag.update_nodes", "POST", "update_nodes", update_tag_nodes, True, "Add or remove nodes from this tag."
            ),
        ),
        doc="Manage a tag.",
    ),
    Route(
        "BootResourcesHandler",
        "boot-resources/",
        (
            Operation("boot_resources.list", "GET", None, list_boot_resources, False, "List boot resources."),
            Operation("boot_resources.create", "POST", None, create_boot_resource, True, "Upload a new boot resource."),
        ),
        doc="Manage the boot resources.",
    ),
    Route(
        "BootResourceHandler",
        "boot-resources/{id}/",
        (
            Operation("boot_resource.read", "GET", None, read_boot_resource, False, "Read a boot resource."),
            Operation("boot_resource.delete", "DELETE", None, delete_boot_resource, True, "Delete a boot resource."),
        ),
        doc="Manage a boot resource.",
    ),
    Route(
        "BootResourceFileUploadHandler",
        "boot-resources/{id}/upload/{file_id}/",
        (
            Operation(
                "boot_resource.upload",
                "PUT",
                None,
                upload_boot_resource_file,
                True,
                "Upload a chunk of a boot resource file.",
            ),
        ),
        doc="Upload a boot resource file.",
    ),
    Route(
        "ScriptsHandler",
        "scripts/",
        (
            Operation("scripts.list", "GET", None, list_scripts, False, "List stored scripts."),
            Operation("scripts.create", "POST", None, create_script, True, "Create a new script."),
        ),
        doc="Manage custom scripts.",
    ),
    Route(
        "ScriptHandler",
        "scripts/{name}/",
        (Operation("script.read", "GET", None, read_script, False, "Read a script."),),
        doc="Manage a custom script.",
    ),
)
