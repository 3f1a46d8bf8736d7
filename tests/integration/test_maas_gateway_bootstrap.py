"""A site bootstrap that is not a cloud-config mapping fails the deploy with a reason, before MAAS is called."""

from __future__ import annotations

import json

import asyncpg
from pydantic import SecretStr

from gpuaas_dev.maas_sim import SimConfig, start, state_of, system_id_for
from gpuaas_maas_gateway.adapters.repository import PostgresGateway
from gpuaas_maas_gateway.entrypoints.main import build_clients
from gpuaas_maas_gateway.service_layer.worker import OperationWorker
from gpuaas_maas_gateway.settings import GatewaySettings, SiteProfile
from tests.integration.test_maas_gateway_double_submit import KEY, pool, record_deploy  # noqa: F401


async def test_a_shell_script_bootstrap_fails_the_deploy_without_calling_maas(pool: asyncpg.Pool) -> None:  # noqa: F811
    runner, port = await start(SimConfig(machines=1, api_key=KEY, seed=7), "127.0.0.1", 0)
    sid = system_id_for("bm-01")
    settings = GatewaySettings(
        maas_url=f"http://127.0.0.1:{port}/MAAS/",
        maas_api_key=SecretStr(KEY),
        site_profiles={"h200-baremetal": SiteProfile(bootstrap_user_data="#!/bin/sh\necho site\n")},
    )
    worker = OperationWorker(settings, PostgresGateway(pool), build_clients(settings))
    try:
        await record_deploy(pool, settings, "deploy-a", sid)
        await worker.step("deploy-a")
        row = await pool.fetchrow("SELECT state, status_message FROM maas_operations")
        [body] = [json.loads(bytes(r["body"])) for r in await pool.fetch("SELECT body FROM outbox")]
    finally:
        for site in worker.sites.values():
            await site.client.close()
        await runner.cleanup()
    assert row["state"] == "failed" and "cloud-config" in row["status_message"]
    assert body["payload"]["reason_code"] == "invalid_bootstrap"
    assert state_of(runner).call_count("deploy", sid) == 0
