"""The dev stack commissions its simulated slice hosts through the MAAS gateway, as a real fleet would.

Slice capability needs a passing commissioning preflight (the `GPUAAS_SLICE_*` lines of
`50-gpuaas-slice-firmware-preflight`), and the fleet seeding fabricates no evidence. So at start the
stack sends one `maas.commission_requested` per slice host (as ops would: upload the script if MAAS
lacks it, commission with it); the MAAS simulator runs it and serves its output, the gateway parses
it into `node.slice_preflight_reported`, and the scheduler records it. `start()` returns once every
slice host's preflight verdict is in (passed, unless a test made a machine's preflight fail).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg

from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.fleet import Fleet

PREFLIGHT_SCRIPT_NAME = "50-gpuaas-slice-firmware-preflight"
# Stand-in body: the real script lives in the infra repository (scripts/maas/commissioning/); the
# simulator does not run scripts, it serves each machine's modelled output.
PREFLIGHT_SCRIPT = (
    "#!/bin/bash\n# 50-gpuaas-slice-firmware-preflight (read-only): prints GPUAAS_SLICE_* lines\n"
    "echo 'GPUAAS_SLICE_PREFLIGHT_SUMMARY failures=0 warnings=0 mode=read-only'\n"
)


async def commission_slice_hosts(nats_options: dict[str, Any], dsn: str, fleet: Fleet, timeout_s: float) -> None:
    import nats

    hosts = [n for n in fleet.nodes if n.kind == "slice_host" and n.maas_system_id]
    if not hosts:
        return
    nc = await nats.connect(**nats_options, name="gpuaas-dev-stack")
    try:
        js = nc.jetstream()
        for node in hosts:
            payload = {
                "operation_id": f"dev-preflight-{node.node_id}-{uuid.uuid4().hex[:8]}",
                "site": "default",
                "system_id": node.maas_system_id,
                "node_id": node.node_id,
                "commissioning_scripts": [PREFLIGHT_SCRIPT_NAME],
                "scripts": [{"name": PREFLIGHT_SCRIPT_NAME, "script": PREFLIGHT_SCRIPT}],
            }
            env = Envelope.wrap(
                "maas.commission_requested",
                payload,
                producer="gpuaas-dev-stack",
                correlation_id=payload["operation_id"],
            )
            await js.publish(
                spec_for("maas.commission_requested").subject(),
                env.model_dump_json().encode(),
                headers={"Nats-Msg-Id": env.event_id},
            )
    finally:
        await nc.close()
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + timeout_s
        wanted = [n.node_id for n in hosts]
        while True:
            reported = await conn.fetchval(
                "SELECT count(*) FROM scheduler.nodes WHERE node_id = ANY($1::text[]) AND preflight_status IS NOT NULL",
                wanted,
            )
            if reported == len(wanted):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"slice host preflight: {reported}/{len(wanted)} reported in {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
    finally:
        await conn.close()
