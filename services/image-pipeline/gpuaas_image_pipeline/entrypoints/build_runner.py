"""The build runner on Postgres: its units of work and its lease renewals on the service's pool."""

from __future__ import annotations

import asyncpg

from gpuaas_common.bus import Bus

from ..adapters.repository import PoolLeases, unit_of_work
from ..service_layer.builds import BUILD_LEASE_S, BuildRunner
from ..settings import ImagePipelineSettings


def build_runner(
    pool: asyncpg.Pool, bus: Bus | None, settings: ImagePipelineSettings, *, lease_s: float = BUILD_LEASE_S
) -> BuildRunner:
    return BuildRunner(unit_of_work(pool), PoolLeases(pool), bus, settings, lease_s=lease_s)
