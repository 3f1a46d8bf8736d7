"""Usage records through the whole stack: the ops-view process, under its own bus identity, follows a slice
allocation from active to released, publishes its one `usage.recorded` through its outbox, and the ops API and
`gpuaas usage export` answer the month with the same seconds."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime

import pytest
from typer.testing import CliRunner

from gpuaas_dev.cli import app
from gpuaas_ops_view.domain.usage import month_bounds, seconds_within, to_the_second

pytestmark = pytest.mark.e2e


def _at(text: str) -> datetime:
    return to_the_second(datetime.fromisoformat(text.replace("Z", "+00:00")))


async def test_a_released_slice_is_one_usage_record_published_and_exported(portal, stack) -> None:
    tenant = f"usage-{uuid.uuid4().hex[:8]}"
    alloc = await portal.request("gpu_slice", gpus=2, tenant_id=tenant)
    active = await portal.wait_state(alloc, "active")
    await portal.release(alloc)
    released = await portal.wait_state(alloc, "released")
    started, stopped = _at(active["occurred_at"]), _at(released["occurred_at"])

    event = await portal.spy.wait_type("usage.recorded", timeout=30, allocation_id=alloc)
    assert event["producer"] == "ops-view"
    assert event["payload"] == {
        "allocation_id": str(alloc),
        "tenant_id": tenant,
        "shape": "gpu_slice",
        "sku": "h200-sxm-slice",
        "gpu_count": 2,
        "region": "default",
        "node_id": active["payload"]["node_id"],
        "started_at": started.isoformat().replace("+00:00", "Z"),
        "stopped_at": stopped.isoformat().replace("+00:00", "Z"),
        "seconds": int((stopped - started).total_seconds()),
        "ended": "released",
        "end_reason_code": None,
    }

    # The month's export, as ops run it against the stack's ops API: the record's seconds inside each month it
    # touches (one, unless the test ran across a month's end) add up to the record.
    months = sorted({started.strftime("%Y-%m"), stopped.strftime("%Y-%m")})
    env = {
        "GPUAAS_OPS_ADMIN_URL": stack.admin_url("ops-view"),
        "GPUAAS_BILLING_TOKEN": stack.principal_secret("billing_token"),
    }
    total = 0
    for month in months:
        res = await asyncio.to_thread(
            CliRunner().invoke,
            app,
            ["usage", "export", "--tenant", tenant, "--month", month, "-o", "json", "--run-dir", str(stack.run_dir)],
            env=env,
        )
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        [record] = doc["items"]
        assert record["allocation_id"] == str(alloc) and not record["open"]
        assert record["seconds"] == seconds_within(started, stopped, *month_bounds(month))
        assert record["gpu_seconds"] == 2 * record["seconds"] and doc["totals"]["seconds"] == record["seconds"]
        total += record["seconds"]
    assert total == event["payload"]["seconds"]
