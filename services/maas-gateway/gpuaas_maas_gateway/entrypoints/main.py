"""`gpuaas-maas-gateway`: MAAS operations resolved by observation."""

from __future__ import annotations

from gpuaas_common.logging import get_logger
from gpuaas_common.runtime import ServiceRuntime, run_service
from gpuaas_common.startup import StartupFailed

from ..adapters.credential_authority import AuthorityClient
from ..adapters.host_credentials import HostCredentials
from ..adapters.maas_client import MaasClient
from ..adapters.metrics import operations_reading
from ..adapters.repository import PostgresGateway, gateway_repositories, unit_of_work_factory
from ..service_layer.commands import OperationHandlers
from ..service_layer.worker import OperationWorker
from ..settings import GatewaySettings

log = get_logger(__name__)


def build_clients(settings: GatewaySettings) -> dict[str, MaasClient]:
    """One client per site, each holding its own key; the keys are read here and nowhere else."""
    return {
        name: MaasClient(
            site.url, site.api_key.get_secret_value(), timeout=settings.maas_timeout_s, ca_file=settings.maas_ca_file
        )
        for name, site in settings.sites().items()
    }


def warn_plain_http(settings: GatewaySettings) -> list[str]:
    """The sites spoken to over plain HTTP (allowed only by GPUAAS_MAAS_INSECURE_HTTP), said once at start."""
    plain = sorted(name for name, site in settings.sites().items() if site.url.lower().startswith("http://"))
    if plain:
        log.warning(
            "maas_plain_http",
            sites=plain,
            why="GPUAAS_MAAS_INSECURE_HTTP: the MAAS key and the deploys' user-data (host creds, tokens) in clear",
        )
    return plain


def build_register(settings: GatewaySettings):
    async def register(rt: ServiceRuntime) -> None:
        assert rt.bus is not None and rt.pool is not None
        rt.bus.repositories = gateway_repositories
        handlers = OperationHandlers(settings)
        rt.bus.subscribe(rt.consumer_spec("maas-gateway-commands"), handlers.handlers())
        clients = build_clients(settings)
        log.info("maas_sites", sites=sorted(clients))
        warn_plain_http(settings)
        host_credentials = None
        if settings.credential_authority_url:
            ca_file = settings.credential_authority_ca_file or settings.nats_ca_file
            if not ca_file or not settings.nats_creds:
                raise StartupFailed(
                    "invalid_settings",
                    "the credential authority is asked with the gateway's own creds, over TLS with a pinned CA:"
                    " GPUAAS_NATS_CREDS and GPUAAS_CREDENTIAL_AUTHORITY_CA_FILE (or GPUAAS_NATS_CA_FILE) are needed",
                    setting="GPUAAS_CREDENTIAL_AUTHORITY_URL",
                )
            host_credentials = HostCredentials(
                AuthorityClient(settings.credential_authority_url, ca_file, settings.nats_creds),
                unit_of_work_factory(rt.pool),
                ttl_s=settings.host_creds_ttl_s,
            )
        # /metrics: operations by kind and state, unknown outcomes' age and deadline (adapters/metrics.py).
        rt.add_reading("maas-operations", operations_reading(rt.pool))
        worker = OperationWorker(settings, PostgresGateway(rt.pool), clients, host_credentials=host_credentials)
        rt.spawn(worker.run(), "maas-operations")

    return register


def main() -> None:
    run_service(
        "maas-gateway",
        GatewaySettings,
        build_register,
        schema="maas_gateway",
        migrations_package="gpuaas_maas_gateway.migrations",
    )


if __name__ == "__main__":
    main()
