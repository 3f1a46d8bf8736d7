"""A migrated scheduler schema, its admin API and the placement steps the scheduler's integration tests share."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from gpuaas_common.contract import messages as m
from gpuaas_common.migrations import apply_migrations
from gpuaas_scheduler.adapters import inventory as inv
from gpuaas_scheduler.entrypoints.admin_http import build_app
from gpuaas_scheduler.service_layer.placement import PlacementPolicy, place

ADMIN_TOKEN = "test-admin-token"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@asynccontextmanager
async def scheduler_pool(dsn: str, max_size: int = 4) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size, server_settings={"search_path": "scheduler"})
    assert pool is not None
    try:
        async with pool.acquire() as conn:
            await apply_migrations(conn, "scheduler", "gpuaas_scheduler.migrations")
        yield pool
    finally:
        await pool.close()


@asynccontextmanager
async def admin_client(pool: asyncpg.Pool) -> AsyncIterator[TestClient]:
    client = TestClient(TestServer(build_app(pool, SecretStr(ADMIN_TOKEN)), host="127.0.0.1"))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def report_ready(pool: asyncpg.Pool, node_id: str, *, parity_failures: int = 0, preflight: str = "passed"):
    """The host's readiness evidence as its agent (a parity run) and MAAS commissioning (the slice preflight)
    report it, through the scheduler's own handlers: the evidence slot approval gates on."""
    from datetime import UTC, datetime

    from gpuaas_scheduler.adapters.repository import scheduler_repositories
    from gpuaas_scheduler.service_layer.evidence import record_parity, record_slice_preflight

    now = datetime.now(UTC)
    async with pool.acquire() as conn, conn.transaction():
        check = m.ParityCheck(check="kvm", status="FAIL" if parity_failures else "PASS", detail="/dev/kvm")
        await record_parity(
            scheduler_repositories(conn),
            m.NodeParityReported(node_id=node_id, checked_at=now, checks=[check], failures=parity_failures, warnings=0),
        )
        await record_slice_preflight(
            scheduler_repositories(conn),
            m.NodeSlicePreflightReported(
                operation_id=f"pf-{uuid.uuid4().hex[:8]}",
                site="default",
                system_id=f"sys-{node_id}",
                node_id=node_id,
                script_name="50-gpuaas-slice-firmware-preflight",
                status=preflight,
                reported_at=now,
            ),
        )


def accepted(gpus=1, shape="gpu_slice", tenant="t1", sku="h200-sxm-slice"):
    return m.AllocationAccepted(
        allocation_id=uuid.uuid4(),
        tenant_id=tenant,
        shape=shape,
        state="accepted",
        seq=2,
        sku=sku,
        gpu_count=gpus,
        region="default",
        image=m.ImageRef(slug="img", digest_sha256="0" * 64, image_path="/img"),
    )


async def run_place(pool, ev, policy=None):
    async with pool.acquire() as conn, conn.transaction():
        return await place(conn, ev, policy or PlacementPolicy())


async def post(api, path, body, key=None, method="POST"):
    headers = {**ADMIN_AUTH, "Idempotency-Key": key or uuid.uuid4().hex}
    resp = await api.request(method, path, json=body, headers=headers)
    return resp.status, await resp.json()


CLEAN = {"mounted": False, "mounted_children": [], "signatures": [], "is_os_disk": False}


def candidate(i, **change):
    c = {
        "candidate_id": f"h1-c{i}",
        "gpu_pci_address": f"0000:{0x18 + i:02x}:00.0",
        "numa_node": 0,
        "pcie_switch": "sw0",
        "nvme_by_id": f"/dev/disk/by-id/nvme-eui.{i:032x}",
        "nvme_evidence": CLEAN,
        "fabric_claim_mode": "per_slot_vf",
        "fabric_vf_pci_address": f"0000:29:00.{i % 8}",
        "mac": f"52:54:00:00:01:{i:02x}",
        "private_ip": f"10.100.0.{10 + i}",
        "ovs_bridge": "ovsbr0",
    }
    c.update(change)
    return c


async def place_and_activate(pool, gpus=2):
    """Placed on `gpus` slots and walked through provisioning and active to releasing, as the allocator would."""
    placed = (await run_place(pool, accepted(gpus))).placed
    async with pool.acquire() as conn, conn.transaction():
        for to, frm in (("provisioning", ("reserved",)), ("active", ("provisioning",)), ("releasing", ("active",))):
            await inv.set_slot_status(conn, placed.allocation_id, to, only_from=frm)
    return placed


async def slot_rows(pool, ids):
    """The slot rows named by `ids`, by slot id."""
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT * FROM node_resource_slots WHERE slot_id = ANY($1::text[])", ids)
    return {r["slot_id"]: dict(r) for r in rows}
