"""`gpuaas-allocator`'s command line (gpuaas_common.service_args): the heavy main is imported only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_main

from ..settings import AllocatorSettings

SUMMARY = (
    "The allocation process manager: validates requests, holds the "
    "allocation state machine, sends node tasks and MAAS commands."
)


def main() -> None:
    service_main("gpuaas-allocator", SUMMARY, AllocatorSettings, "gpuaas_allocator.entrypoints.main:main")
