"""One vocabulary: the contract's word lists (gpuaas_common.contract.vocabulary) are written once.

Each payload Literal and each SQL CHECK of one of them holds exactly its enum's values, and no source file outside
the contract package holds a copy of one: a tuple, list, set, frozenset, dict (its keys) or Literal[...] written with
two or more string values of one enum (one value alone is no list, and words such as `active` or `failed` name other
things too), nor a console template a tuple or array of them.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel

from gpuaas_common.contract import (
    AllocationState,
    HostMode,
    Shape,
    SlotStatus,
    TaskType,
    WipePolicy,
)
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.catalog import NODE_TASK_TYPES
from gpuaas_common.contract.vocabulary import VOCABULARIES

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("services", "libs", "tools", "bench")
CONTRACT = Path("libs/gpuaas_common/contract")
CONSOLE = Path("services/ops-view/gpuaas_ops_view/entrypoints/web")

# Files other branches of issue 39 rewrite that still hold copies: file -> the vocabularies copied there. The merger
# empties this once those branches are in (and test_pending_entries_still_hold_copies fails on an entry whose copy
# is gone, so the set cannot go stale).
PENDING: dict[str, frozenset[str]] = {
    # WIPE_POLICIES: the policy -> accepted proof methods table, keyed by the policies as strings.
    "services/scheduler/gpuaas_scheduler/domain/approval.py": frozenset({"WipePolicy"}),
    # released_slot_status: {"released": "provisioning", "failed": "active"}, keyed by allocation states.
    "services/scheduler/gpuaas_scheduler/domain/node_claims.py": frozenset({"AllocationState"}),
    # WipePolicy = Literal[...] (every policy); NodeIn.mode Literal["slice", "baremetal"]; ModeIn.mode Literal[every
    # mode]. Literal[HostMode.SLICE, ...] renders the same OpenAPI schema (test_members_in_literal_render_the_same).
    "services/scheduler/gpuaas_scheduler/service_layer/admin/models.py": frozenset({"WipePolicy", "HostMode"}),
    # repair_slot: ("cleanup_blocked", "disabled", AWAITING_WIPE), the statuses a repair takes.
    "services/scheduler/gpuaas_scheduler/service_layer/admin/slots.py": frozenset({"SlotStatus"}),
    # A walk's slot check: ("available", "awaiting_wipe"), the statuses a re-approved slot may have.
    "services/scheduler/gpuaas_scheduler/service_layer/host_walk.py": frozenset({"SlotStatus"}),
}

# Lists that hold values of a vocabulary but are another list: (file, the vocabulary words in it, in order) -> what
# the list is.
NOT_COPIES: dict[tuple[str, tuple[str, ...]], str] = {
    ("services/maas-gateway/gpuaas_maas_gateway/adapters/metrics.py", ("accepted", "failed")): (
        "a MAAS operation's states"
    ),
    ("services/ops-view/gpuaas_ops_view/service_layer/queries.py", ("requested", "released", "failed")): (
        "a MAAS operation's statuses, as the console filters them"
    ),
    ("services/ops-view/gpuaas_ops_view/entrypoints/web/templates/maas.html", ("requested", "released", "failed")): (
        "a MAAS operation's statuses, the console's filter choices"
    ),
    ("bench/hostile_host.py", ("active", "released", "failed")): "a bench report's fields (allocations counted)",
    ("bench/pipeline.py", ("active", "released", "failed")): "a bench report's fields (allocations counted)",
    ("bench/pipeline.py", ("active", "failed")): "the bench report fields a latency run keeps",
}
_WORDS = frozenset(e.value for enum in VOCABULARIES for e in enum)


def words(values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(v for v in values if v in _WORDS)


def copied(values: tuple[str, ...]) -> frozenset[str]:
    """The vocabularies `values` is a copy of: those with the most of its values, when that is two or more (a
    list of slot statuses shares three words with the allocation states, and is a list of slot statuses)."""
    counts = {enum.__name__: len(set(values) & {e.value for e in enum}) for enum in VOCABULARIES}
    most = max(counts.values())
    return frozenset(name for name, n in counts.items() if n == most) if most >= 2 else frozenset()


def python_lists(source: str) -> Iterator[tuple[int, tuple[str, ...]]]:
    """Every literal collection of the source with its string elements (a dict: its keys; Literal[...] and
    frozenset({...}) are a tuple and a set to the parser)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items: list[ast.expr | None] = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = list(node.keys)
        else:
            continue
        values = tuple(i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str))
        if values:
            yield node.lineno, values


_BRACKETED = re.compile(r"\(([^()]*)\)|\[([^\[\]]*)\]")
_QUOTED = re.compile(r"""^\s*(?:"([^"]*)"|'([^']*)')\s*$""")


def template_lists(source: str) -> Iterator[tuple[int, tuple[str, ...]]]:
    """Every parenthesised or bracketed list of quoted strings of a template or script (a Jinja tuple, a JS array)."""
    for match in _BRACKETED.finditer(source):
        parts = (match.group(1) if match.group(1) is not None else match.group(2)).split(",")
        quoted = [_QUOTED.match(p) for p in parts if p.strip()]
        if len(quoted) >= 2 and all(quoted):
            yield source.count("\n", 0, match.start()) + 1, tuple(q.group(1) or q.group(2) or "" for q in quoted if q)


def _scanned_files() -> Iterator[Path]:
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.is_relative_to(CONTRACT) or {"migrations", "tests", "node_modules"} & set(rel.parts):
                continue
            yield rel
    for suffix in ("*.html", "*.js"):
        yield from (p.relative_to(ROOT) for p in sorted((ROOT / CONSOLE).rglob(suffix)))


def copies_by_file() -> dict[str, list[tuple[int, frozenset[str], tuple[str, ...]]]]:
    found: dict[str, list[tuple[int, frozenset[str], tuple[str, ...]]]] = {}
    for rel in _scanned_files():
        source = (ROOT / rel).read_text()
        lists = python_lists(source) if rel.suffix == ".py" else template_lists(source)
        for line, values in lists:
            names = copied(values)
            if names:
                found.setdefault(str(rel), []).append((line, names, values))
    return found


# --- the contract's own lists -------------------------------------------------------------------------


def _values(enum: type[StrEnum]) -> tuple[str, ...]:
    return tuple(e.value for e in enum)


def test_payload_literals_hold_exactly_the_enums_values() -> None:
    assert get_args(m.Shape) == _values(Shape)
    # Lifecycle events never carry `requested` (it never leaves the allocator's transaction); a query may ask it.
    assert get_args(m.AllocationState) == tuple(v for v in _values(AllocationState) if v != "requested")
    assert get_args(m.QueryState) == _values(AllocationState)
    assert get_args(m.HostMode) == _values(HostMode)
    assert get_args(m.SlotStatus) == _values(SlotStatus)
    assert get_args(m.WipePolicy) == _values(WipePolicy)
    assert get_args(m.AllocationEnd) == (AllocationState.RELEASED, AllocationState.FAILED)


def test_node_task_types_are_the_catalogs() -> None:
    assert NODE_TASK_TYPES == _values(TaskType)
    assert all(type(t) is str for t in NODE_TASK_TYPES), "the catalog renders plain strings into the contract"


def _checks(migrations: str, column: str) -> list[frozenset[str]]:
    """Every `CHECK (column IN (...))` of a service's migrations, in the order they apply."""
    pattern = re.compile(rf"CHECK\s*\(\s*{column}\s+IN\s*\(([^)]*)\)", re.S)
    return [
        frozenset(re.findall(r"'([^']*)'", found))
        for sql in sorted((ROOT / migrations).glob("*.sql"))
        for found in pattern.findall(sql.read_text())
    ]


def test_the_databases_checks_hold_exactly_the_enums_values() -> None:
    """Migrations are history and stay as written; the CHECK in force (the last one) must match the enum."""
    scheduler = "services/scheduler/gpuaas_scheduler/migrations"
    slot_checks = [c for c in _checks(scheduler, "status") if {"available", "reserved"} <= c]
    assert slot_checks[-1] == set(_values(SlotStatus))
    assert _checks(scheduler, "mode")[-1] == set(_values(HostMode))
    policies = _checks(scheduler, "destructive_wipe_policy")
    assert len(policies) == 2 and all(c == set(_values(WipePolicy)) for c in policies)


class _Carrier(BaseModel):
    shape: m.Shape
    mode: m.HostMode
    name: str


def test_members_travel_as_their_values() -> None:
    """Why a member may replace its string anywhere: the bytes on the bus and in rows stay the same."""
    carrier = _Carrier(shape=Shape.BAREMETAL, mode=HostMode.SLICE, name=TaskType.SLICE_VM_RELEASE)
    assert carrier.model_dump_json() == '{"shape":"baremetal","mode":"slice","name":"slice.vm_release"}'
    assert all(type(v) is str for v in carrier.model_dump().values())
    assert json.dumps({SlotStatus.AVAILABLE: [AllocationState.ACTIVE]}) == '{"available": ["active"]}'
    assert f"{WipePolicy.NVME_FORMAT}" == str(WipePolicy.NVME_FORMAT) == "nvme_format"
    assert "drained" in (HostMode.DRAINED,) and hash(HostMode.DRAINED) == hash("drained")


def test_members_in_literal_render_the_same() -> None:
    """A Literal of members is the same schema as the Literal of their strings (for the admin API models)."""
    from pydantic import TypeAdapter

    as_members = TypeAdapter(Literal[HostMode.SLICE, HostMode.BAREMETAL]).json_schema()
    assert as_members == TypeAdapter(Literal["slice", "baremetal"]).json_schema()


# --- no other copy ------------------------------------------------------------------------------------------


def test_the_scanner_finds_copies_and_only_copies() -> None:
    source = (
        'A = ("slice", "baremetal", "x")\nB = frozenset({"blkdiscard"})\nC: Literal["accepted", "placed"]\n'
        'D = {"slice.vm_provision": 1, "image.cache_prewarm": 2}\nE = ("active", "pending")\n'
    )
    found = {line: copied(values) for line, values in python_lists(source) if copied(values)}
    assert found == {
        1: {"HostMode"},
        3: {"AllocationState"},
        4: {"TaskType"},
    }
    assert copied(("reserved", "provisioning", "active", "releasing")) == {"SlotStatus"}
    html = '{% if s in ("cleanup_blocked", "disabled") %}{% for k in ("slice_host", "baremetal") %}'
    assert [copied(v) for _, v in template_lists(html)] == [{"SlotStatus"}, frozenset()]
    assert [copied(v) for _, v in template_lists("const modes = ['slice', 'drained'];")] == [{"HostMode"}]


def test_no_copy_of_a_vocabulary_outside_the_contract() -> None:
    problems = []
    for path, hits in copies_by_file().items():
        for line, names, values in hits:
            if (path, words(values)) in NOT_COPIES or names <= PENDING.get(path, frozenset()):
                continue
            problems.append(f"{path}:{line}: a copy of {', '.join(sorted(names))}: {values}")
    assert not problems, "use gpuaas_common.contract's enums instead:\n" + "\n".join(problems)


def test_pending_entries_still_hold_copies() -> None:
    found = copies_by_file()
    for path, names in PENDING.items():
        there = frozenset().union(*(n for _, n, _ in found.get(path, [])))
        assert names <= there, f"{path} holds no copy of {sorted(names - there)} any more: remove it from PENDING"


def test_not_copies_entries_still_exist() -> None:
    found = {(path, words(values)) for path, hits in copies_by_file().items() for _, _, values in hits}
    stale = [key for key in NOT_COPIES if key not in found]
    assert not stale, f"entries of NOT_COPIES that match nothing any more: {stale}"
