"""The node rules, defined once in domain/placement/rules.py (`SLICE_RULES`, `BAREMETAL_RULES`), mean the same in
Python and in the placement SQL (adapters/inventory/node_sql.py): on one fleet of real rows, a good node and one
node per violated rule, every rule is evaluated both ways, Python on the facts the why-not answer reads and SQL
on the rows they come from, for several requests."""

from __future__ import annotations

from datetime import datetime, timezone

import asyncpg
import pytest

from gpuaas_common.profiles import hugepages_1g_needed
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.adapters.inventory import TAG_BAREMETAL, TAG_SLICE, node_facts, refresh_nodes
from gpuaas_scheduler.adapters.inventory.node_sql import (
    BAREMETAL_RULE_SQL,
    IMPLIED_BY,
    PARAMETERS,
    SLICE_RULE_SQL,
    parameters,
)
from gpuaas_scheduler.adapters.inventory.predicates import hugepage_table
from gpuaas_scheduler.domain.placement import BAREMETAL_RULES, SLICE_RULES, NodeRule, Request, node_filter

from .scheduler_db import scheduler_pool

SLUG, DIGEST, DRIVER = "img", "d" * 64, "550.90.07"
T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
PER_GPU = hugepages_1g_needed(synthetic.PROFILE, 1)


def _slots(node: str, *indexes: int) -> str:
    return "ARRAY[" + ", ".join(f"'{node}-s{i}'" for i in indexes) + "]"


def _modules(node: str, fabric_manager: str) -> list[str]:
    return [
        f"UPDATE node_resource_slots SET module_id = substring(slot_id from '-s([0-9])$')::int + 1 "
        f"WHERE node_id = '{node}'",
        f"UPDATE nodes SET fabric_manager_version = '{fabric_manager}' WHERE node_id = '{node}'",
    ]


def _claim(node: str, kind: str, slot: str | None = None) -> str:
    slot_sql = f"'{slot}'" if slot else "NULL"
    nvme = f"(SELECT nvme_by_id FROM node_resource_slots WHERE slot_id = '{slot}')" if slot else "NULL"
    return (
        "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_id, claim_kind, status, fencing_epoch, "
        f"tenant_id, gpus, nvme_by_id) VALUES (gen_random_uuid(), '{node}', {slot_sql}, '{kind}', 'held', "
        f"nextval('fencing_epoch_seq'), 't1', 1, {nvme})"
    )


def _drift(node: str, slot: str) -> str:
    return (
        "INSERT INTO node_drift (node_id, slot_id, kind, subject, detail, status, first_reported_at, "
        f"last_reported_at) VALUES ('{node}', '{slot}', 'gpu', '{slot}', 'moved', 'open', now(), now())"
    )


# Each slice case: the rule it breaks first (None: passes them all) and the statements that make it so.
SLICE_CASES: dict[str, tuple[str | None, list[str]]] = {
    "good": (None, []),
    "good_partitioned": (None, _modules("{n}", DRIVER)),
    "region": ("region", ["UPDATE nodes SET region = 'elsewhere' WHERE node_id = '{n}'"]),
    "sku": ("sku", ["UPDATE nodes SET sku = 'h200-sxm' WHERE node_id = '{n}'"]),
    "profile_intent": (
        "profile_intent",
        [f"UPDATE nodes SET maas_tags = ARRAY['{TAG_BAREMETAL}'] WHERE node_id = '{{n}}'"],
    ),
    "host_mode": ("host_mode", ["UPDATE nodes SET mode = 'converting' WHERE node_id = '{n}'"]),
    "maintenance": ("maintenance", ["UPDATE nodes SET maintenance = true WHERE node_id = '{n}'"]),
    "draining": ("draining", ["UPDATE nodes SET draining = true WHERE node_id = '{n}'"]),
    "not_ready": ("not_ready", ["UPDATE nodes SET schedulable = false WHERE node_id = '{n}'"]),
    "preflight_failed": ("preflight_failed", ["UPDATE nodes SET preflight_status = 'failed' WHERE node_id = '{n}'"]),
    "preflight_none": ("preflight_missing", ["UPDATE nodes SET preflight_status = NULL WHERE node_id = '{n}'"]),
    "preflight_missing": ("preflight_missing", ["UPDATE nodes SET preflight_status = 'missing' WHERE node_id = '{n}'"]),
    "parity_none": ("parity", ["UPDATE nodes SET parity_failures = NULL WHERE node_id = '{n}'"]),
    "parity": ("parity", ["UPDATE nodes SET parity_failures = 2 WHERE node_id = '{n}'"]),
    "drift_reported": ("drift_reported", ["UPDATE nodes SET drift_open = true WHERE node_id = '{n}'"]),
    "image_cache": ("image_cache", ["DELETE FROM node_image_readiness WHERE node_id = '{n}'"]),
    "image_digest": ("image_cache", ["UPDATE node_image_readiness SET digest_sha256 = 'e' WHERE node_id = '{n}'"]),
    "fabric_manager_version": ("fabric_manager_version", _modules("{n}", "535.0")),
    "hugepages_none": ("hugepages_missing", ["UPDATE nodes SET hugepages_1g_total = NULL WHERE node_id = '{n}'"]),
    "hugepages_missing": (
        "hugepages_missing",
        [f"UPDATE nodes SET hugepages_1g_total = {PER_GPU * 3} WHERE node_id = '{{n}}'"],
    ),
    "in_use": ("in_use", [_claim("{n}", "node_exclusive")]),
    "drifted_slots": ("drifted_slots", [_drift("{n}", f"{{n}}-s{i}") for i in range(5)]),
    "free_slot_count": (
        "free_slot_count",
        [
            "UPDATE node_resource_slots SET status = 'disabled' WHERE slot_id = ANY("
            + _slots("{n}", 0, 1, 2, 3, 4)
            + ")"
        ],
    ),
    "hugepages_insufficient": (
        "hugepages_insufficient",
        [
            f"UPDATE nodes SET hugepages_1g_total = {PER_GPU * 5} WHERE node_id = '{{n}}'",
            _claim("{n}", "slot", "{n}-s0"),
            _claim("{n}", "slot", "{n}-s1"),
        ],
    ),
    "nvlink_partition": (
        "nvlink_partition",
        [
            *_modules("{n}", DRIVER),
            "UPDATE node_resource_slots SET status = 'disabled' WHERE slot_id = ANY(" + _slots("{n}", 0, 4) + ")",
        ],
    ),
    "topology": (
        "topology",
        ["UPDATE node_resource_slots SET status = 'reserved' WHERE slot_id = ANY(" + _slots("{n}", 1, 3, 5, 7) + ")"],
    ),
}

BAREMETAL_CASES: dict[str, tuple[str | None, list[str]]] = {
    "good": (None, []),
    "region": ("region", ["UPDATE nodes SET region = 'elsewhere' WHERE node_id = '{n}'"]),
    "sku": ("sku", ["UPDATE nodes SET sku = 'other' WHERE node_id = '{n}'"]),
    "profile_intent": (
        "profile_intent",
        [f"UPDATE nodes SET maas_tags = ARRAY['{TAG_SLICE}'] WHERE node_id = '{{n}}'"],
    ),
    "host_mode": ("host_mode", ["UPDATE nodes SET mode = 'drained' WHERE node_id = '{n}'"]),
    "approved_slots": (
        "approved_slots",
        [
            "INSERT INTO node_resource_slots (slot_id, node_id, profile, status) "
            "VALUES ('{n}-s0', '{n}', 'p', 'disabled')"
        ],
    ),
    "maintenance": ("maintenance", ["UPDATE nodes SET maintenance = true WHERE node_id = '{n}'"]),
    "draining": ("draining", ["UPDATE nodes SET draining = true WHERE node_id = '{n}'"]),
    "not_ready": ("not_ready", ["UPDATE nodes SET schedulable = false WHERE node_id = '{n}'"]),
    "in_use": ("in_use", [_claim("{n}", "node_exclusive")]),
}

SLICE_REQUESTS = [
    Request("gpu_slice", gpus, "default", "h200-sxm-slice", "t1", gate, driver)
    for gpus in (4, 1, 2, 3, 8)
    for gate, driver in (((SLUG, DIGEST), DRIVER), (None, None))
]
BAREMETAL_REQUESTS = [
    Request("baremetal", 8, "default", "h200-sxm"),
    Request("baremetal", 8, "default", "h200-sxm-slice"),
]


@pytest.fixture
async def conn(fresh_db):
    async with scheduler_pool(fresh_db, max_size=1) as pool, pool.acquire() as c:
        yield c


async def _fleet(conn: asyncpg.Connection) -> tuple[dict[str, str], dict[str, str]]:
    """One node per case (slice hosts s<case number>, baremetal hosts bm<case number>); their node ids by case."""
    await synthetic.build(conn, slice_hosts=len(SLICE_CASES), baremetal_hosts=len(BAREMETAL_CASES), prefix="s")
    slices = {case: f"s{i:05d}" for i, case in enumerate(SLICE_CASES, 1)}
    baremetal = {case: f"bm{i:05d}" for i, case in enumerate(BAREMETAL_CASES, 1)}
    await conn.executemany(
        "INSERT INTO node_image_readiness (node_id, slug, status, digest_sha256, schedulable, reported_at) "
        "VALUES ($1, $2, 'verified', $3, true, $4)",
        [(n, SLUG, DIGEST, T0) for n in slices.values()],
    )
    for cases, nodes in ((SLICE_CASES, slices), (BAREMETAL_CASES, baremetal)):
        for case, (_rule, statements) in cases.items():
            for statement in statements:
                await conn.execute(statement.replace("{n}", nodes[case]))
    await refresh_nodes(conn)
    return slices, baremetal


def _values(req: Request) -> dict[str, object]:
    slug, digest = req.image_gate or (None, None)
    skus = [req.sku, "h200-sxm-slice"] if req.shape == "baremetal" else [req.sku]
    return {
        "region": req.region,
        "sku": req.sku,
        "skus": skus,
        "gpus": req.gpus,
        "slug": slug,
        "digest": digest,
        "driver": req.driver_version,
        "pages": hugepage_table(),
    }


async def _sql_holds(conn: asyncpg.Connection, template: str, req: Request) -> dict[str, bool]:
    """The predicate on every node, its parameters numbered in the order it names them."""
    used = sorted(parameters(template), key=PARAMETERS.index)
    values = _values(req)
    predicate = template.format(**{name: i for i, name in enumerate(used, 1)})
    rows = await conn.fetch(
        f"SELECT n.node_id, COALESCE(({predicate}), false) AS holds FROM nodes n", *[values[u] for u in used]
    )
    return {r["node_id"]: r["holds"] for r in rows}


def test_every_rule_has_a_case_and_a_predicate() -> None:
    assert {r for r, _ in SLICE_CASES.values() if r} == {r.name for r in SLICE_RULES} == set(SLICE_RULE_SQL)
    assert {r for r, _ in BAREMETAL_CASES.values() if r} == {r.name for r in BAREMETAL_RULES} == set(BAREMETAL_RULE_SQL)
    assert all(parameters(t) <= set(PARAMETERS) for t in [*SLICE_RULE_SQL.values(), *BAREMETAL_RULE_SQL.values()])


def _first(rules: tuple[NodeRule, ...], facts, req: Request) -> str | None:
    return next((r.name for r in rules if not r.holds(facts, req)), None)


async def test_each_case_breaks_the_rule_it_names_first(conn) -> None:
    slices, baremetal = await _fleet(conn)
    facts = {f.node_id: f for f in await node_facts(conn, (SLUG, DIGEST))}
    req = SLICE_REQUESTS[0]
    for case, (rule, _) in SLICE_CASES.items():
        assert _first(SLICE_RULES, facts[slices[case]], req) == rule, case
    for case, (rule, _) in BAREMETAL_CASES.items():
        assert _first(BAREMETAL_RULES, facts[baremetal[case]], BAREMETAL_REQUESTS[0]) == rule, case
    # The bucket is the rule's, but for the slots only drift keeps from the request.
    assert node_filter(facts[slices["drifted_slots"]], req) == "drift_reported"


async def test_python_and_sql_agree_rule_by_rule(conn) -> None:
    await _fleet(conn)
    for rules, table, requests in (
        (SLICE_RULES, SLICE_RULE_SQL, SLICE_REQUESTS),
        (BAREMETAL_RULES, BAREMETAL_RULE_SQL, BAREMETAL_REQUESTS),
    ):
        for req in requests:
            facts = await node_facts(conn, req.image_gate)
            for rule in rules:
                sql = await _sql_holds(conn, table[rule.name], req)
                python = {f.node_id: rule.holds(f, req) for f in facts}
                assert sql == python, f"{rule.name} for {req}: " + ", ".join(
                    f"{n} sql={sql[n]} python={python[n]}" for n in sorted(sql) if sql[n] != python[n]
                )


async def test_a_rule_left_out_of_a_query_holds_wherever_the_rule_that_implies_it_holds(conn) -> None:
    """The placement queries check the stronger rule alone (node_sql.IMPLIED_BY): on every node and request,
    wherever it holds, so does the one it implies."""
    await _fleet(conn)
    by_name = {r.name: r for r in SLICE_RULES}
    for req in SLICE_REQUESTS:
        for f in await node_facts(conn, req.image_gate):
            for weaker, stronger in IMPLIED_BY.items():
                if by_name[stronger].holds(f, req):
                    assert by_name[weaker].holds(f, req), f"{f.node_id}: {stronger} holds, {weaker} does not"
