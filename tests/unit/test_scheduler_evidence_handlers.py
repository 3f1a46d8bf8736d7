"""The scheduler's evidence handlers (parity, topology, drift, slice preflight, image cache, slot wipe) through an
in-memory unit of work: each is parse, load the `Host` (or the evidence's repository), one method, save, with the
tests' fakes (tests/fakes/scheduler.py) that the repository contract test holds to the Postgres ones. Every event
is checked against the contract on the subject it would go out on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuaas_common.bus import HandlerContext, PermanentError
from gpuaas_common.contract import Envelope
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.unit_of_work import FakeUnitOfWork
from gpuaas_scheduler.domain.host_walk import HostWalk
from gpuaas_scheduler.service_layer import slot_wipe
from gpuaas_scheduler.service_layer.evidence import EMULATED_REFUSED
from gpuaas_scheduler.service_layer.handlers import Scheduler
from gpuaas_scheduler.service_layer.host_walk import HostWalker, WalkPolicy
from gpuaas_scheduler.service_layer.placement import PlacementPolicy
from tests.fakes.scheduler import Slot, WipeAsk, World, fake_repositories

NOW = datetime.now(UTC)
EARLIER, LATER = NOW - timedelta(hours=1), NOW - timedelta(minutes=1)
GPU, VF = "0000:1b:00.0", "0000:1c:00.1"


def _disk(slot_id: str) -> str:
    return f"/dev/disk/by-id/nvme-{slot_id}"


class NoWalks:
    """No host walk is open: the walker's part of the parity and topology handlers finds none."""

    async def by_rediscovery(self, node_id: str, action_id: str) -> HostWalk | None:
        return None


def _scheduler(*, allow_emulated: bool = False) -> Scheduler:
    walker = HostWalker(WalkPolicy(), walks_of=lambda ctx: NoWalks())  # type: ignore[arg-type, return-value]
    return Scheduler(PlacementPolicy(allow_emulated_slots=allow_emulated), walker, drift_reports_kept=2)


def _world(**row: Any) -> World:
    """A slice host h1 with one awaiting-wipe slot, bound whole (GPU, VF, disk, MAC, IP)."""
    world = World()
    world.nodes.add("h1")
    world.row("h1").accepts_slices = True
    world.row("h1").maas_system_id = "sys-h1"
    for k, v in row.items():
        setattr(world.row("h1"), k, v)
    world.slots["s0"] = Slot(
        "s0",
        "h1",
        "awaiting_wipe",
        _disk("s0"),
        gpu_pci_address=GPU,
        fabric_vf_pci_address=VF,
        mac="52:54:00:00:00:01",
        private_ip="10.0.0.10",
        fabric_claim_mode="per_slot_vf",
    )
    return world


async def _handle(
    world: World, handler: str, type_: str, payload: Any, *, subject: str | None = None, **kw: Any
) -> tuple[FakeUnitOfWork[Any], list[tuple[str, dict[str, Any]]]]:
    """One message through its handler in a unit of work that commits: the unit of work and its events (type,
    payload), each valid by the contract."""
    env = Envelope.wrap(type_, payload.model_dump(mode="json"), producer="node-agent", correlation_id="c-1")
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        ctx = HandlerContext(env, payload, subject or f"gpuaas.node.{payload.node_id}.report.x", "test", 1, uow)
        await getattr(_scheduler(**kw), handler)(ctx)
        await uow.commit()
    events = []
    for p in uow.events.pending:
        default_validator().validate(p.subject, p.envelope.model_dump(mode="json"))
        events.append((p.envelope.type, p.envelope.payload))
    return uow, events


# --- parity ------------------------------------------------------------------------------------------------------


def _parity(node: str = "h1", *, at: datetime = LATER, failures: int = 0, **kw: Any) -> m.NodeParityReported:
    checks = [m.ParityCheck(check="kvm", status="PASS", detail="/dev/kvm")]
    checks += [m.ParityCheck(check="vfio_binding", status="FAIL", detail="bound to nvidia")] * failures
    return m.NodeParityReported(node_id=node, checked_at=at, checks=checks, failures=failures, warnings=0, **kw)


@pytest.mark.parametrize(
    ("row", "report", "allow", "failures", "refused"),
    [
        # Newer than the last one taken and than the reset: taken as the host's parity.
        ({}, _parity(failures=2), False, 2, None),
        ({"parity_reported_at": EARLIER, "parity_failures": 3}, _parity(), False, 0, None),
        # A lab host's report passes only where emulated slots are allowed; elsewhere one failure more, and why.
        ({}, _parity(profile="emulated"), False, 1, EMULATED_REFUSED),
        ({}, _parity(profile="emulated"), True, 0, None),
    ],
)
async def test_a_newer_parity_report_is_the_hosts_parity(
    row: dict[str, Any], report: m.NodeParityReported, allow: bool, failures: int, refused: str | None
) -> None:
    world = _world(**row)
    _uow, events = await _handle(world, "on_parity", "node.parity_reported", report, allow_emulated=allow)
    r = world.row("h1")
    assert (r.parity_failures, r.parity_reported_at) == (failures, LATER)
    assert r.parity_detail is not None and r.parity_detail.get("refused") == refused
    assert r.parity_detail["source"] == "node-agent"
    assert events == []


@pytest.mark.parametrize(
    "row",
    [
        {"parity_reported_at": NOW, "parity_failures": 3},  # a newer report was taken: a late redelivery
        {"evidence_reset_at": NOW},  # from before the host's redeploy
    ],
)
async def test_a_stale_parity_report_changes_nothing(row: dict[str, Any]) -> None:
    world = _world(**row)
    await _handle(world, "on_parity", "node.parity_reported", _parity(failures=1))
    r = world.row("h1")
    assert (r.parity_failures, r.parity_detail) == (row.get("parity_failures"), None)
    assert r.parity_reported_at == row.get("parity_reported_at")


async def test_a_report_of_an_unknown_node_changes_nothing() -> None:
    world = _world()
    await _handle(world, "on_parity", "node.parity_reported", _parity("ghost", failures=1))
    await _handle(world, "on_drift", "node.drift_reported", _drift("ghost", [_item()]))
    assert "ghost" not in world.rows and world.drift == {} and world.drift_reports == []


@pytest.mark.parametrize(
    ("row", "applied", "status", "outcome"),
    [
        ({}, True, "succeeded", "parity passed (0 warning(s))"),
        ({"parity_reported_at": NOW}, False, "failed", None),
    ],
)
async def test_a_parity_report_answers_the_ask_that_named_it(
    row: dict[str, Any], applied: bool, status: str, outcome: str | None
) -> None:
    world = _world(**row)
    world.asks["parity-1"] = {"action_id": "parity-1", "node_id": "h1", "kind": "parity", "status": "requested"}
    world.asks["parity-1"] |= {"outcome": None, "result": {}}
    await _handle(world, "on_parity", "node.parity_reported", _parity(task_id="parity-1"))
    ask = world.asks["parity-1"]
    assert ask["status"] == status and ask["result"]["parity"]["applied"] == ("applied" if applied else "stale")
    if outcome is not None:
        assert ask["outcome"] == outcome


async def test_a_parity_report_naming_another_nodes_ask_leaves_it_open() -> None:
    world = _world()
    world.nodes.add("h2")
    world.asks["parity-1"] = {"action_id": "parity-1", "node_id": "h2", "kind": "parity", "status": "requested"}
    world.asks["parity-1"] |= {"outcome": None, "result": {}}
    await _handle(world, "on_parity", "node.parity_reported", _parity(task_id="parity-1"))
    assert world.asks["parity-1"]["status"] == "requested" and world.asks["parity-1"]["result"] == {}


# --- topology ----------------------------------------------------------------------------------------------------


def _topology(*, at: datetime = LATER, candidates: int = 1) -> m.NodeTopologyReported:
    slots = [
        m.CandidateSlot(
            index=i,
            gpu_pci_address=f"0000:{0x1B + i:02x}:00.0",
            nvme_by_id=_disk(f"c{i}"),
            fabric_vf_pci_address=VF,
            mac="52:54:00:00:00:01",
            private_ip="10.0.0.10",
            ovs_bridge="br0",
            ovs_port=f"p{i}",
            complete=True,
        )
        for i in range(candidates)
    ]
    nvme = [
        m.NvmeDevice(
            kernel_name="nvme0n1", by_id=_disk("c0"), size_bytes=1, mounted=False, is_os_disk=False, candidate=True
        )
    ]
    return m.NodeTopologyReported(
        node_id="h1",
        discovered_at=at,
        candidate_slots=slots,
        nvme=nvme,
        hugepages_1g_total=64,
        hugepages_1g_free=60,
        fabric_manager=m.FabricManagerInfo(mode="shared_nvswitch", version="550.1", active=True),
    )


@pytest.mark.parametrize(
    ("row", "taken"),
    [
        ({}, True),
        ({"topology_reported_at": EARLIER}, True),
        ({"topology_reported_at": LATER}, True),  # the same report again rewrites the same values
        ({"topology_reported_at": NOW}, False),
        ({"evidence_reset_at": LATER}, False),
    ],
)
async def test_a_topology_report_replaces_the_unapproved_candidates_only_when_newer(
    row: dict[str, Any], taken: bool
) -> None:
    world = _world(**row)
    world.candidates["h1-old"] = ("h1-old", "h1")
    await _handle(world, "on_topology", "node.topology_reported", _topology(candidates=2))
    r = world.row("h1")
    if not taken:
        assert (set(world.candidates), r.topology) == ({"h1-old"}, None)
        return
    assert r.topology is not None and r.topology_reported_at == LATER and r.topology_reported
    assert (r.topology.hugepages_1g_total, r.topology.hugepages_1g_free) == (64, 60)
    assert r.topology.fabric_manager == ("shared_nvswitch", "550.1", True)
    assert sorted(world.candidates) == ["h1-0000:1b:00.0", "h1-0000:1c:00.0"]
    # The disk evidence travels with the candidate whose disk the report describes; none: not approvable.
    assert world.candidates["h1-0000:1b:00.0"][-1] is not None and world.candidates["h1-0000:1c:00.0"][-1] is None


# --- drift -------------------------------------------------------------------------------------------------------


def _item(kind: str = "domain_unmanaged", subject: str = "vm-x", **kw: Any) -> m.NodeDrift:
    return m.NodeDrift(kind=kind, subject=subject, detail="found", **kw)  # type: ignore[arg-type]


def _drift(node: str = "h1", items: list[m.NodeDrift] | None = None, *, at: datetime = LATER) -> m.NodeDriftReported:
    return m.NodeDriftReported(node_id=node, checked_at=at, drift=items or [])


@pytest.mark.parametrize(
    ("held", "items", "after"),
    [
        # New items open, on the slot whose device they name or else on the node.
        (
            {},
            [_item(), _item("disk_dirty", "d", devices=[_disk("s0")])],
            {("domain_unmanaged", "vm-x", None): "open", ("disk_dirty", "d", "s0"): "open"},
        ),
        # What the report no longer names resolves; what it still names stays as it was (acknowledged too).
        (
            {("domain_unmanaged", "vm-x", None): "acknowledged", ("disk_dirty", "d", "s0"): "open"},
            [_item()],
            {("domain_unmanaged", "vm-x", None): "acknowledged", ("disk_dirty", "d", "s0"): "resolved"},
        ),
        # A swept item is evidence only: the agent already removed the orphan.
        ({}, [_item(swept=True)], {}),
    ],
)
async def test_a_drift_report_opens_keeps_and_resolves_the_hosts_items(
    held: dict[Any, str], items: list[m.NodeDrift], after: dict[Any, str]
) -> None:
    world = _world(drift_reported_at=EARLIER)
    world.drift["h1"] = dict(held)
    await _handle(world, "on_drift", "node.drift_reported", _drift(items=items))
    assert world.drift["h1"] == after
    assert world.row("h1").drift_reported_at == LATER
    assert [(n, at) for _event, n, at in world.drift_reports] == [("h1", LATER)]  # kept as it came


@pytest.mark.parametrize("row", [{"drift_reported_at": LATER}, {"drift_reported_at": NOW}, {"evidence_reset_at": NOW}])
async def test_a_drift_report_not_newer_changes_nothing(row: dict[str, Any]) -> None:
    """Not even one of the same time: taken twice, it would be kept twice."""
    world = _world(**row)
    world.drift["h1"] = {("disk_dirty", "d", "s0"): "open"}
    await _handle(world, "on_drift", "node.drift_reported", _drift(items=[]))
    assert world.drift["h1"] == {("disk_dirty", "d", "s0"): "open"} and world.drift_reports == []


async def test_a_host_keeps_only_its_newest_drift_reports() -> None:
    world = _world()
    for minutes in (30, 20, 10):
        await _handle(world, "on_drift", "node.drift_reported", _drift(at=NOW - timedelta(minutes=minutes)))
    assert [at for _e, _n, at in sorted(world.drift_reports, key=lambda r: r[2])] == [
        NOW - timedelta(minutes=20),
        NOW - timedelta(minutes=10),
    ]


# --- slice preflight and image cache ------------------------------------------------------------------------------


def _preflight(op: str, status: str = "passed", *, system_id: str = "sys-h1", at: datetime = LATER) -> Any:
    return m.NodeSlicePreflightReported(
        operation_id=op,
        site="default",
        system_id=system_id,
        script_name="50-gpuaas-slice-firmware-preflight",
        status=status,  # type: ignore[arg-type]
        reasons=[] if status == "passed" else ["firmware too old"],
        reported_at=at,
    )


@pytest.mark.parametrize(
    ("held", "report", "kept_for", "preflight"),
    [
        (None, _preflight("pf-1"), "h1", ("passed", LATER, "pf-1")),
        # A newer report is applied already: this one is kept as evidence, the status stays.
        (("passed", NOW, "pf-0"), _preflight("pf-1", "failed"), "h1", ("passed", NOW, "pf-0")),
        # A machine no node carries: kept with no node.
        (None, _preflight("pf-1", system_id="sys-nobody"), None, None),
    ],
)
async def test_a_slice_preflight_is_kept_and_applied_when_newest(
    held: Any, report: Any, kept_for: str | None, preflight: Any
) -> None:
    world = _world(preflight=held)
    env = Envelope.wrap(
        "node.slice_preflight_reported", report.model_dump(mode="json"), producer="maas-gateway", correlation_id="c"
    )
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        ctx = HandlerContext(env, report, "gpuaas.maas.x", "test", 1, uow)
        await _scheduler().on_slice_preflight(ctx)
        await uow.commit()
    assert world.preflights == {"pf-1": kept_for}
    assert world.row("h1").preflight == preflight


async def test_a_commissioning_preflight_settles_its_ask() -> None:
    world = _world()
    world.asks["pf-1"] = {"action_id": "pf-1", "node_id": "h1", "kind": "commission", "status": "requested"}
    world.asks["pf-1"] |= {"outcome": None, "result": {}}
    report = _preflight("pf-1", "failed")
    env = Envelope.wrap(
        "node.slice_preflight_reported", report.model_dump(mode="json"), producer="maas-gateway", correlation_id="c"
    )
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        await _scheduler().on_slice_preflight(HandlerContext(env, report, "gpuaas.maas.x", "test", 1, uow))
        await uow.commit()
    ask = world.asks["pf-1"]
    assert (ask["status"], ask["outcome"]) == ("failed", "commissioning preflight failed: firmware too old")
    assert ask["result"]["preflight"]["status"] == "failed"


@pytest.mark.parametrize(
    ("held", "stored"),
    [
        (None, ("verified", True, LATER)),
        (("pulling", False, EARLIER), ("verified", True, LATER)),
        (("failed", False, NOW), ("failed", False, NOW)),  # a newer state is stored: a late redelivery
    ],
)
async def test_an_image_cache_state_is_stored_when_newest(held: Any, stored: Any) -> None:
    world = _world()
    if held:
        world.images[("h1", "ubuntu-24")] = held
    ev = m.ImageNodeCacheChanged(
        node_id="h1", slug="ubuntu-24", status="verified", digest_sha256=None, schedulable=True
    )
    env = Envelope.wrap(
        "image.node_cache_changed", ev.model_dump(mode="json"), producer="image-pipeline", correlation_id="c"
    )
    env = env.model_copy(update={"occurred_at": LATER})
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        await _scheduler().on_image_cache(HandlerContext(env, ev, "gpuaas.image.x", "test", 1, uow))
        await uow.commit()
    assert world.images[("h1", "ubuntu-24")] == stored


# --- slot wipe ---------------------------------------------------------------------------------------------------


def _proof(device: str, *, verified: bool = True) -> m.WipeProof:
    return m.WipeProof(device=device, method="blkdiscard", verified=verified)


def _wipe_report(*outcomes: m.SlotWipeOutcome, node: str = "h1") -> m.NodeSlotWipeReported:
    return m.NodeSlotWipeReported(task_id="wipe-1", node_id=node, outcomes=list(outcomes))


def _asked(world: World, *slot_ids: str) -> None:
    world.wipes += [
        WipeAsk("wipe-1", s, "h1", _disk(s), "blkdiscard", "maintenance", "undrain", "ops") for s in slot_ids
    ]


@pytest.mark.parametrize(
    ("outcome", "status", "closed", "counts"),
    [
        # Proven by the host on the disk asked: the slot is placeable again.
        (
            m.SlotWipeOutcome(slot_id="s0", device=_disk("s0"), proof=_proof(_disk("s0"))),
            "available",
            "passed",
            {"freed": 1, "blocked": 0, "kept": 0, "ignored": 0},
        ),
        # Not verified, or not done: blocked until ops act.
        (
            m.SlotWipeOutcome(slot_id="s0", device=_disk("s0"), proof=_proof(_disk("s0"), verified=False)),
            "cleanup_blocked",
            "failed",
            {"freed": 0, "blocked": 1, "kept": 0, "ignored": 0},
        ),
        (
            m.SlotWipeOutcome(slot_id="s0", device=_disk("s0"), reason_code="disk_leased"),
            "cleanup_blocked",
            "failed",
            {"freed": 0, "blocked": 1, "kept": 0, "ignored": 0},
        ),
        # An outcome for a slot the task never asked frees nothing; the asked slot with no outcome is blocked.
        (
            m.SlotWipeOutcome(slot_id="s9", device=_disk("s9"), proof=_proof(_disk("s9"))),
            "cleanup_blocked",
            "failed",
            {"freed": 0, "blocked": 1, "kept": 0, "ignored": 1},
        ),
    ],
)
async def test_a_wipe_report_frees_or_blocks_each_asked_slot_and_announces_them(
    outcome: m.SlotWipeOutcome, status: str, closed: str, counts: dict[str, int]
) -> None:
    world = _world()
    _asked(world, "s0")
    subject = "gpuaas.node.h1.report.slot_wipe"
    _uow, events = await _handle(
        world, "on_slot_wipe", "node.slot_wipe_reported", _wipe_report(outcome), subject=subject
    )
    assert world.slots["s0"].status == status
    assert [w.outcome for w in world.wipes] == [closed]
    assert [(t, p["cause"], [s["status"] for s in p["slots"]]) for t, p in events] == [
        ("scheduler.slots_changed", "wipe", [status])
    ]
    assert world.refreshed == [["h1"]]
    # The service function's own answer: what the handler logs.
    again = _world()
    _asked(again, "s0")
    async with FakeUnitOfWork(fake_repositories(again), "scheduler") as uow:
        assert await slot_wipe.wipe_reported(uow.repos, uow.events, subject, _wipe_report(outcome)) == counts


async def test_a_wipe_report_of_a_claimed_slot_keeps_it_where_it_is() -> None:
    world = _world()
    world.slots["s0"].status = "active"
    _asked(world, "s0")
    outcome = m.SlotWipeOutcome(slot_id="s0", device=_disk("s0"), proof=_proof(_disk("s0")))
    await _handle(
        world,
        "on_slot_wipe",
        "node.slot_wipe_reported",
        _wipe_report(outcome),
        subject="gpuaas.node.h1.report.slot_wipe",
    )
    assert world.slots["s0"].status == "active" and [w.outcome for w in world.wipes] == ["passed"]


@pytest.mark.parametrize(
    ("report", "subject", "code"),
    [
        # The subject is the sender's identity: a body naming another node is refused, nothing freed.
        (
            _wipe_report(m.SlotWipeOutcome(slot_id="s0", device=_disk("s0"), proof=_proof(_disk("s0")))),
            "gpuaas.node.h2.report.slot_wipe",
            "foreign_wipe_report",
        ),
        (
            _wipe_report(m.SlotWipeOutcome(slot_id="s0", device=_disk("s0"), proof=_proof(_disk("s0"))), node="ghost"),
            "gpuaas.node.ghost.report.slot_wipe",
            "unknown_node",
        ),
    ],
)
async def test_a_wipe_report_is_refused_from_another_host_or_for_an_unknown_node(
    report: m.NodeSlotWipeReported, subject: str, code: str
) -> None:
    world = _world()
    _asked(world, "s0")
    env = Envelope.wrap(
        "node.slot_wipe_reported", report.model_dump(mode="json"), producer="node-agent", correlation_id="c"
    )
    async with FakeUnitOfWork(fake_repositories(world), "scheduler") as uow:
        with pytest.raises(PermanentError) as err:
            await _scheduler().on_slot_wipe(HandlerContext(env, report, subject, "test", 1, uow))
    assert err.value.reason_code == code
    assert world.slots["s0"].status == "awaiting_wipe" and [w.outcome for w in world.wipes] == [None]
    assert uow.events.pending == [] and not uow.committed


# --- the aggregate's rule: newer than the last report taken and than the evidence reset ---------------------------

T = datetime(2026, 1, 1, tzinfo=UTC)
SECOND = timedelta(seconds=1)


@pytest.mark.parametrize(
    ("last", "reset", "at", "parity_and_topology", "drift"),
    [
        (None, None, T, True, True),
        (T, None, T + SECOND, True, True),
        (T, None, T, True, False),  # the same time again: rewritten by parity and topology, never drift
        (T, None, T - SECOND, False, False),
        (None, T, T, False, False),  # a report from the reset's own moment describes the host before it
        (None, T, T + SECOND, True, True),
    ],
)
def test_a_host_takes_a_report_only_when_newer_than_the_last_and_the_reset(
    last: datetime | None, reset: datetime | None, at: datetime, parity_and_topology: bool, drift: bool
) -> None:
    from gpuaas_scheduler.domain.host import EvidenceTimes, Host
    from gpuaas_scheduler.domain.host_mode import HostFacts

    def host() -> Host:
        return Host(HostFacts("h1", "slice"), T, evidence=EvidenceTimes(last, last, last, reset))

    parity, topology, drifted = host(), host(), host()
    took = [
        parity.record_parity(failures=0, detail={}, checked_at=at) == "applied",
        topology.record_topology(
            discovered_at=at, blockers=[], hugepages_1g=(None, None), fabric_manager=(None, None, None), candidates=[]
        )
        == "applied",
    ]
    assert took == [parity_and_topology] * 2
    assert (
        drifted.record_drift(event_id="e", checked_at=at, report=[], reported={}, held=[], keep=1) is not None
    ) == drift
    # A report not taken records nothing to save, and leaves the host's evidence as it was.
    for h, taken in ((parity, parity_and_topology), (topology, parity_and_topology), (drifted, drift)):
        assert bool(h.changes) == taken
        assert taken or h.evidence == EvidenceTimes(last, last, last, reset)
