"""`gpuaas-maas-gateway`: MAAS operations resolved by observation."""

from __future__ import annotations

from gpuaas_common.runtime import ServiceRuntime, run_service

from ..adapters.maas_client import MaasClient
from ..service_layer.operations import OperationHandlers, OperationWorker
from ..settings import GatewaySettings


def build_register(settings: GatewaySettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.bus is not None and rt.pool is not None
        handlers = OperationHandlers(settings)
        rt.bus.subscribe(
            rt.consumer_spec("maas-gateway-commands"),
            {"maas.deploy_requested": handlers.on_command, "maas.release_requested": handlers.on_command},
        )
        client = MaasClient(settings.maas_url, settings.maas_api_key.get_secret_value(),
                            timeout=settings.maas_timeout_s)
        rt.spawn(OperationWorker(settings, rt.pool, client).run(), "maas-operations")

    return register


def main() -> None:
    settings = GatewaySettings()
    run_service("maas-gateway", settings, build_register(settings), schema="maas_gateway",
                migrations_package="gpuaas_maas_gateway.migrations")


if __name__ == "__main__":
    main()
