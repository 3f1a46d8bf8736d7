"""`gpuaas-ops-view`'s command line (gpuaas_common.service_args): the heavy main is imported only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_main

from ..settings import OpsViewSettings

SUMMARY = "Read models that follow the event streams (allocations, fleet, images, MAAS, dead letters) and the ops API."


def main() -> None:
    service_main("gpuaas-ops-view", SUMMARY, OpsViewSettings, "gpuaas_ops_view.entrypoints.main:main")
