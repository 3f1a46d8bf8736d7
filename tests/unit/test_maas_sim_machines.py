"""Every transition and error of the simulated MAAS machine, with time injected (no sleeps)."""

from __future__ import annotations

import re

import pytest

from gpuaas_dev.maas_sim.errors import BadRequest, NodeStateViolation, NoMachineAvailable
from gpuaas_dev.maas_sim.machines import STATUS_LABELS, Machine, NodeStatus, Timers, system_id_for

S = NodeStatus
T0 = 1000.0
TIMERS = Timers(deploying=2.0, releasing=1.0, disk_erasing=1.5, commissioning=3.0, testing=4.0)


def machine_in(status: NodeStatus, owner: str | None = "admin") -> Machine:
    m = Machine(system_id="abc123", hostname="bm-01", status=status)
    m.owner = None if status is S.READY else owner
    return m


def deploy(m: Machine, now: float = T0, **kw: object) -> None:
    m.deploy(now, TIMERS, owner="admin", osystem="ubuntu", distro_series="noble", **kw)  # type: ignore[arg-type]


# ---- status names ----------------------------------------------------------------------------------

EXPECTED_LABELS = [
    "New",
    "Commissioning",
    "Failed commissioning",
    "Missing",
    "Ready",
    "Reserved",
    "Deployed",
    "Retired",
    "Broken",
    "Deploying",
    "Allocated",
    "Failed deployment",
    "Releasing",
    "Releasing failed",
    "Disk erasing",
    "Failed disk erasing",
    "Rescue mode",
    "Entering rescue mode",
    "Failed to enter rescue mode",
    "Exiting rescue mode",
    "Failed to exit rescue mode",
    "Testing",
    "Failed testing",
]


def test_status_enum_matches_maas_numbers_and_labels() -> None:
    assert [int(s) for s in NodeStatus] == list(range(23))
    assert [STATUS_LABELS[s] for s in NodeStatus] == EXPECTED_LABELS
    assert S.FAILED_DEPLOYMENT.filter_name == "failed_deployment"


# ---- allocate --------------------------------------------------------------------------------------


def test_allocate_ready_machine() -> None:
    m = machine_in(S.READY)
    m.allocate(T0, "admin", agent_name="alloc-1")
    assert (m.status, m.owner, m.agent_name) == (S.ALLOCATED, "admin", "alloc-1")


@pytest.mark.parametrize("status", [s for s in NodeStatus if s is not S.READY])
def test_allocate_refused_unless_ready(status: NodeStatus) -> None:
    m = machine_in(status)
    with pytest.raises(NoMachineAvailable) as err:
        m.allocate(T0, "admin")
    assert err.value.status == 409
    assert err.value.body == "No machine with system ID abc123 available."
    assert m.status is status


# ---- deploy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [S.READY, S.ALLOCATED])
def test_deploy_goes_to_deploying_then_deployed(status: NodeStatus) -> None:
    m = machine_in(status)
    deploy(m, user_data=b"#cloud-config\n", agent_name="a1")
    assert (m.status, m.owner, m.power_state) == (S.DEPLOYING, "admin", "on")
    assert m.last_deploy is not None and m.last_deploy["user_data"] == b"#cloud-config\n"
    assert m.deploys == [{"agent_name": "a1", "at": T0}]
    if status is S.READY:
        # Ready -> Allocated -> Deploying in one call.
        assert [t.to_status for t in m.history] == [S.ALLOCATED, S.DEPLOYING]
    m.advance(T0 + 1.999, TIMERS)
    assert m.status is S.DEPLOYING
    m.advance(T0 + 2.0, TIMERS)
    assert (m.status, m.status.label) == (S.DEPLOYED, "Deployed")
    assert (m.osystem, m.distro_series, m.agent_name) == ("ubuntu", "noble", "a1")


@pytest.mark.parametrize("status", [s for s in NodeStatus if s not in (S.READY, S.ALLOCATED)])
def test_deploy_refused_in_every_other_state(status: NodeStatus) -> None:
    m = machine_in(status)
    with pytest.raises(NodeStateViolation) as err:
        deploy(m)
    assert err.value.status == 409
    assert err.value.body == f"Can't deploy a machine that is in the '{STATUS_LABELS[status]}' state"
    assert m.status is status
    assert m.deploys == []  # a refused deploy is not counted as one MAAS committed


def test_deploy_can_end_in_failed_deployment_with_message() -> None:
    m = machine_in(S.READY)
    m.inject_failure("deploying", "Failed deployment: curtin failed")
    deploy(m)
    m.advance(T0 + 5, TIMERS)
    assert m.status is S.FAILED_DEPLOYMENT
    assert m.status_message == "Failed deployment: curtin failed"
    # The failure happened at the deadline, not when it was observed.
    assert m.history[-1].at == T0 + 2.0


# ---- release ---------------------------------------------------------------------------------------

RELEASABLE = [
    S.ALLOCATED,
    S.RESERVED,
    S.BROKEN,
    S.DEPLOYING,
    S.DEPLOYED,
    S.FAILED_DEPLOYMENT,
    S.FAILED_DISK_ERASING,
    S.FAILED_RELEASING,
]


@pytest.mark.parametrize("status", [S.READY, S.RELEASING])
def test_release_is_a_noop_when_ready_or_releasing(status: NodeStatus) -> None:
    m = machine_in(status)
    m.release(T0, TIMERS)
    assert m.status is status and m.history == []


@pytest.mark.parametrize("status", RELEASABLE)
def test_release_goes_through_releasing_to_ready(status: NodeStatus) -> None:
    m = machine_in(status)
    m.agent_name = "a1"
    m.release(T0, TIMERS)
    assert m.status is S.RELEASING
    m.advance(T0 + 0.5, TIMERS)
    assert m.status is S.RELEASING
    m.advance(T0 + 1.0, TIMERS)
    assert (m.status, m.owner, m.agent_name, m.power_state) == (S.READY, None, "", "off")


# MAAS's release: only `erase` erases; `secure_erase` uses the drive's own erase where it has one and otherwise
# falls back to the full overwrite, or to the quick erase when that was asked too.
@pytest.mark.parametrize(
    "flags, secure_supported, mode",
    [
        ({"erase": True}, True, "full"),
        ({"erase": True, "secure_erase": True}, True, "secure"),
        ({"erase": True, "secure_erase": True}, False, "full"),
        ({"erase": True, "secure_erase": True, "quick_erase": True}, False, "quick"),
        ({"erase": True, "secure_erase": True, "quick_erase": True}, True, "secure"),
        ({"erase": True, "quick_erase": True}, True, "quick"),
        ({"secure_erase": True}, True, None),
        ({"quick_erase": True}, True, None),
    ],
)
def test_release_erases_as_maas_does_for_its_parameters(
    flags: dict[str, bool], secure_supported: bool, mode: str | None
) -> None:
    m = machine_in(S.DEPLOYED)
    m.secure_erase_supported = secure_supported
    m.release(T0, TIMERS, **flags)
    assert (m.status, m.erase_mode) == ((S.DISK_ERASING, mode) if mode else (S.RELEASING, None))
    assert m.last_release is not None and m.last_release["erase_mode"] == mode
    m.advance(T0 + 1.5, TIMERS)
    assert m.status is S.READY
    # What the release asked stays readable once the machine is Ready again.
    assert {k: m.last_release[k] for k in flags} == flags
    assert m.erase_exit_status == (0 if mode else None)


def test_erase_can_fail() -> None:
    m = machine_in(S.DEPLOYED)
    m.inject_failure("disk_erasing", "wipe failed")
    m.release(T0, TIMERS, erase=True)
    m.advance(T0 + 10, TIMERS)
    assert m.status is S.FAILED_DISK_ERASING
    assert m.erase_exit_status == 1
    m.release(T0 + 11, TIMERS)  # Failed disk erasing is releasable again.
    assert m.status is S.RELEASING


def test_release_timer_can_fail() -> None:
    m = machine_in(S.DEPLOYED)
    m.inject_failure("releasing", "power off failed")
    m.release(T0, TIMERS)
    m.advance(T0 + 10, TIMERS)
    assert m.status is S.FAILED_RELEASING


def test_release_during_deploy_cancels_the_deploy_timer() -> None:
    m = machine_in(S.READY)
    deploy(m)
    m.release(T0 + 1, TIMERS)
    m.advance(T0 + 2.5, TIMERS)  # the old deploy deadline passes without effect
    assert m.status is S.READY


@pytest.mark.parametrize("status", [s for s in NodeStatus if s not in RELEASABLE and s not in (S.READY, S.RELEASING)])
def test_release_refused_in_other_states(status: NodeStatus) -> None:
    m = machine_in(status)
    with pytest.raises(NodeStateViolation) as err:
        m.release(T0, TIMERS)
    assert err.value.status == 409
    assert err.value.body == (f"Machine cannot be released in its current state ('{STATUS_LABELS[status]}').")


# ---- commission ------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [S.NEW, S.FAILED_COMMISSIONING, S.READY, S.BROKEN])
def test_commission_runs_commissioning_then_testing_then_ready(status: NodeStatus) -> None:
    m = machine_in(status)
    m.commission(T0, TIMERS)
    assert m.status is S.COMMISSIONING
    m.advance(T0 + 3.0, TIMERS)
    assert m.status is S.TESTING
    m.advance(T0 + 6.999, TIMERS)
    assert m.status is S.TESTING
    m.advance(T0 + 7.0, TIMERS)
    assert m.status is S.READY


def test_a_late_poll_sees_the_whole_commissioning_chain() -> None:
    m = machine_in(S.NEW)
    m.commission(T0, TIMERS)
    m.advance(T0 + 100, TIMERS)
    assert m.status is S.READY
    assert [(t.to_status, t.at) for t in m.history] == [
        (S.COMMISSIONING, T0),
        (S.TESTING, T0 + 3.0),
        (S.READY, T0 + 7.0),
    ]


@pytest.mark.parametrize("phase,outcome", [("commissioning", S.FAILED_COMMISSIONING), ("testing", S.FAILED_TESTING)])
def test_commissioning_and_testing_can_fail(phase: str, outcome: NodeStatus) -> None:
    m = machine_in(S.NEW)
    m.inject_failure(phase, f"{phase} failed")
    m.commission(T0, TIMERS)
    m.advance(T0 + 100, TIMERS)
    assert m.status is outcome and m.status_message == f"{phase} failed"


@pytest.mark.parametrize(
    "status", [s for s in NodeStatus if s not in (S.NEW, S.FAILED_COMMISSIONING, S.READY, S.BROKEN)]
)
def test_commission_refused_in_other_states(status: NodeStatus) -> None:
    m = machine_in(status)
    with pytest.raises(BadRequest) as err:
        m.commission(T0, TIMERS)
    assert err.value.status == 400
    assert err.value.body == {"__all__": ["Commission is not available because of the current state of the node."]}
    assert err.value.content_type == "application/json"


# ---- abort -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "start,expected",
    [
        (S.COMMISSIONING, S.NEW),
        (S.DEPLOYING, S.ALLOCATED),
        (S.DISK_ERASING, S.FAILED_DISK_ERASING),
    ],
)
def test_abort(start: NodeStatus, expected: NodeStatus) -> None:
    m = machine_in(S.READY)
    if start is S.COMMISSIONING:
        m.commission(T0, TIMERS)
    elif start is S.DEPLOYING:
        deploy(m)
    else:
        m.status, m.owner = S.DEPLOYED, "admin"
        m.release(T0, TIMERS, erase=True)
    assert m.status is start
    m.abort(T0 + 0.5)
    assert m.status is expected
    m.advance(T0 + 100, TIMERS)  # the aborted phase's timer no longer fires
    assert m.status is expected


def test_abort_testing_returns_to_the_state_before_commissioning() -> None:
    m = machine_in(S.READY)
    m.commission(T0, TIMERS)
    m.advance(T0 + 3.5, TIMERS)
    assert m.status is S.TESTING
    m.abort(T0 + 4)
    assert m.status is S.READY


@pytest.mark.parametrize(
    "status",
    [s for s in NodeStatus if s not in (S.COMMISSIONING, S.DEPLOYING, S.DISK_ERASING, S.TESTING)],
)
def test_abort_refused_in_other_states(status: NodeStatus) -> None:
    m = machine_in(status)
    with pytest.raises(NodeStateViolation) as err:
        m.abort(T0)
    assert err.value.status == 409
    assert err.value.body == (f"Cannot abort in current state: node abc123 is in state {STATUS_LABELS[status]}.")


# ---- timers and ids --------------------------------------------------------------------------------


def test_timer_changes_apply_to_phases_started_afterwards() -> None:
    m = machine_in(S.READY)
    deploy(m)
    faster = TIMERS.updated(deploying=0.1)
    m.advance(T0 + 0.5, faster)
    assert m.status is S.DEPLOYING
    with pytest.raises(ValueError):
        TIMERS.updated(nonsense=1)


def test_system_id_for_is_deterministic_short_lowercase_alnum() -> None:
    ids = {system_id_for(f"bm-{i:02d}") for i in range(1, 100)}
    assert len(ids) == 99
    assert all(re.fullmatch(r"[a-z0-9]{6}", i) for i in ids)
    assert system_id_for("bm-01") == system_id_for("bm-01")


def test_machine_json_has_the_fields_clients_use() -> None:
    data = machine_in(S.READY).to_json()
    for key in (
        "system_id",
        "hostname",
        "fqdn",
        "status",
        "status_name",
        "status_message",
        "owner",
        "osystem",
        "distro_series",
        "hwe_kernel",
        "power_state",
        "power_type",
        "tag_names",
        "ip_addresses",
        "architecture",
        "cpu_count",
        "memory",
        "zone",
        "pool",
        "locked",
        "resource_uri",
    ):
        assert key in data
    assert data["ip_addresses"][0].startswith("127.")
    assert data["resource_uri"] == "/MAAS/api/2.0/machines/abc123/"


def test_every_commissioning_run_gets_a_new_result_id_and_its_scripts() -> None:
    m = machine_in(S.READY)
    assert m.to_json()["current_commissioning_result_id"] is None
    m.commission(T0, TIMERS, ("update_firmware",))
    m.advance(T0 + 100, TIMERS)
    m.commission(T0 + 100, TIMERS, ("gpuaas-fw",))
    assert m.to_json()["current_commissioning_result_id"] == 2
    assert m.commissioning_scripts == ("gpuaas-fw",)


def test_a_refused_commission_leaves_the_result_id_alone() -> None:
    m = machine_in(S.DEPLOYED)
    with pytest.raises(BadRequest):
        m.commission(T0, TIMERS, ("update_firmware",))
    assert m.current_commissioning_result_id == 0


# ---- boot resources and scripts (pure stores) -------------------------------------------------------

from gpuaas_dev.maas_sim.resources import BootResourceStore, ScriptStore  # noqa: E402


@pytest.mark.parametrize(
    "fields, errors",
    [
        ({"name": "", "architecture": "amd64/generic", "content": b"x"}, {"name"}),
        ({"name": "custom/a", "architecture": "", "content": b"x"}, {"architecture"}),
        ({"name": "custom/a", "architecture": "amd64", "content": b"x"}, {"architecture"}),
        ({"name": "ubuntu/a", "architecture": "amd64/generic", "content": b"x"}, {"name"}),
        ({"name": "custom/a", "architecture": "amd64/generic", "filetype": "zip", "content": b"x"}, {"filetype"}),
        ({"name": "custom/a", "architecture": "amd64/generic", "sha256": "0" * 64}, {"size"}),
        ({"name": "custom/a", "architecture": "amd64/generic", "size": "12"}, {"sha256"}),
        ({"name": "custom/a", "architecture": "amd64/generic", "sha256": "0" * 64, "size": "x"}, {"size"}),
    ],
)
def test_boot_resource_create_field_errors(fields: dict, errors: set) -> None:
    with pytest.raises(BadRequest) as err:
        BootResourceStore().create(**fields)
    assert set(err.value.body) == errors


def test_same_name_and_architecture_is_one_resource_with_a_new_set() -> None:
    store = BootResourceStore()
    first = store.create(name="custom/img", architecture="amd64/generic", content=b"abc")
    second = store.create(name="img", architecture="amd64/generic", content=b"abcd")
    other_arch = store.create(name="custom/img", architecture="arm64/generic", content=b"abc")
    assert first.id == second.id != other_arch.id and len(first.sets) == 2
    assert store.complete_names() == {"img"}


def test_script_store_rules() -> None:
    scripts = ScriptStore()
    made = scripts.create(name="fw", script="#!/bin/sh\n", script_type="commissioning")
    assert made.to_json("/MAAS/api/2.0/")["type_name"] == "commissioning"
    assert scripts.known("fw") and scripts.known("update_firmware") and not scripts.known("nope")
    for kwargs, field in (
        ({"name": "fw", "script": "#!/bin/sh"}, "name"),
        ({"name": "b", "script": "echo"}, "script"),
        ({"name": "c", "script": "#!/bin/sh", "script_type": "weird"}, "type"),
    ):
        with pytest.raises(BadRequest) as err:
            scripts.create(script_type=kwargs.pop("script_type", "testing"), **kwargs)
        assert field in err.value.body
