"""`gpuaas-maas-gateway`'s command line (gpuaas_common.service_args): the heavy main is imported only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_main

from ..settings import GatewaySettings

SUMMARY = "MAAS operations (allocate, deploy, release) resolved by observation."


def main() -> None:
    service_main("gpuaas-maas-gateway", SUMMARY, GatewaySettings, "gpuaas_maas_gateway.entrypoints.main:main")
