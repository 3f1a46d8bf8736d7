"""Both admin APIs fuzzed live against their own committed OpenAPI documents (schemathesis + hypothesis).

For every generated request (valid and invalid ones, path ids sometimes swapped for ids that exist so the
state-changing paths run too):
- no 5xx; every status, header and body is the documented one (schemathesis' conformance checks);
- every 4xx is the shared error shape and carries the request id the response header names;
- a refused mutation left the service's schema exactly as it was (all tables but the audit log compared
  before and after), and wrote one audit row with its status;
- an accepted mutation stored its answer under its Idempotency-Key and wrote one audit row; sent again
  with the same key it replays the same status and body without acting twice.

The server runs on its own event loop in a thread because schemathesis calls it synchronously.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import requests
import schemathesis
import yaml
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gpuaas_common.contract import spec_for
from gpuaas_common.migrations import apply_migrations
from gpuaas_dev.testing.servers import PostgresServer
from gpuaas_image_pipeline.entrypoints.admin_http import AdminApi as ImageAdmin
from gpuaas_image_pipeline.entrypoints.build_runner import build_runner
from gpuaas_image_pipeline.settings import ImagePipelineSettings
from gpuaas_scheduler.adapters import synthetic
from gpuaas_scheduler.entrypoints.admin_http import admin_api as scheduler_admin

# The admin APIs' audit records on the bus (gpuaas_common.admin_http.audit.announce).
AUDIT_SUBJECTS = tuple(
    spec_for(t).subject() for t in ("scheduler.admin_request_recorded", "image.admin_request_recorded")
)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "fuzz-admin-token"
MUTATIONS = {"POST", "PUT", "PATCH", "DELETE"}
# Examples per service: a couple of hundred in all keeps `make test` well under a minute on 2 cores.
EXAMPLES = 150
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


class LiveApi:
    """An admin app, its pool and a fresh database, on an event loop of their own."""

    def __init__(
        self,
        pg: PostgresServer,
        schema: str,
        migrations: str,
        seed: Callable[[asyncpg.Connection], Awaitable[None]],
        make_app: Callable[[asyncpg.Pool], web.Application],
    ) -> None:
        self.pg, self.schema, self.migrations, self.seed, self.make_app = pg, schema, migrations, seed, make_app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.db = f"t_{uuid.uuid4().hex[:12]}"

    def run(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)  # type: ignore[arg-type]

    def __enter__(self) -> "LiveApi":
        self.thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        admin = await asyncpg.connect(self.pg.dsn)
        await admin.execute(f'CREATE DATABASE "{self.db}"')
        await admin.close()
        dsn = self.pg.dsn.rsplit("/", 1)[0] + f"/{self.db}"
        self.pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, server_settings={"search_path": self.schema})
        async with self.pool.acquire() as conn:
            await apply_migrations(conn, self.schema, self.migrations)
            await self.seed(conn)
        self.runner = web.AppRunner(self.make_app(self.pool), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    def __exit__(self, *exc: object) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.pool.close()
        admin = await asyncpg.connect(self.pg.dsn)
        await admin.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')
        await admin.close()

    async def _fingerprint(self) -> dict[str, str]:
        """Every table of the schema but the audit log, as one digest each; the outbox without the audit log's
        events (each audited request, a replay or a refusal too, publishes its record)."""
        async with self.pool.acquire() as conn:
            tables = [
                r["table_name"]
                for r in await conn.fetch(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = $1 "
                    "AND table_type = 'BASE TABLE' AND table_name <> 'admin_requests'",
                    self.schema,
                )
            ]
            audit_events = f"WHERE t.subject NOT IN ({', '.join(repr(x) for x in AUDIT_SUBJECTS)})"
            return {
                t: await conn.fetchval(
                    f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM \"{t}\" t "
                    f"{audit_events if t == 'outbox' else ''}"
                )
                for t in tables
            }

    def fingerprint(self) -> dict[str, str]:
        return self.run(self._fingerprint())

    def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return self.run(self.pool.fetch(sql, *args))


def _load(path: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_dict(yaml.safe_load((ROOT / path).read_text()))


def _strategy(schema: schemathesis.BaseSchema, skip: set[tuple[str, str]]) -> st.SearchStrategy:
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if (op.method.upper(), op.path) not in skip]
    assert ops
    return st.one_of(
        *[
            op.as_strategy(generation_mode=mode)
            for op in ops
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        ]
    )


def _fuzz(
    api: LiveApi, schema: schemathesis.BaseSchema, known: dict[str, list[str]], skip: set[tuple[str, str]] = frozenset()
) -> dict[str, int]:  # type: ignore[assignment]
    figures = {"examples": 0, "mutations_accepted": 0, "mutations_refused": 0, "replays": 0}
    session = requests.Session()

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=_strategy(schema, skip), swap=st.booleans(), pick=st.integers(min_value=0, max_value=1000))
    def run(case: Any, swap: bool, pick: int) -> None:
        if swap:  # an id that exists, so the change itself runs and not only the 404
            for name in list(case.path_parameters or {}):
                if name in known:
                    case.path_parameters[name] = known[name][pick % len(known[name])]
        figures["examples"] += 1
        mutation = case.method.upper() in MUTATIONS
        before = api.fingerprint() if mutation else None
        # Client request ids may repeat (they are fuzzed too): this request's audit rows are the new ones.
        last_audit = api.fetch("SELECT coalesce(max(id), 0) AS id FROM admin_requests")[0]["id"]
        headers = {"Authorization": f"Bearer {TOKEN}"}
        resp = case.call(base_url=api.base_url, session=session, headers=headers)
        case.validate_response(resp, checks=CHECKS, headers=headers)
        request_id = resp.headers["x-request-id"][0]  # schemathesis: lower-cased names, lists of values
        if resp.status_code >= 400:
            error = resp.json()["error"]
            assert set(error) == {"code", "message", "details", "request_id"}, error
            assert error["request_id"] == request_id
        if not mutation:
            return
        audit = api.fetch("SELECT status, request_id FROM admin_requests WHERE id > $1 ORDER BY id", last_audit)
        assert all(r["request_id"] == request_id for r in audit)
        key = (case.headers or {}).get("Idempotency-Key")
        if resp.status_code >= 400:
            figures["mutations_refused"] += 1
            assert api.fingerprint() == before, f"{case.method} {case.formatted_path} -> {resp.status_code} left rows"
            # A request refused before it named a valid request id or reached a route is not audited.
            if resp.status_code not in (401, 404, 405) or audit:
                assert [r["status"] for r in audit] == [resp.status_code], audit
            return
        assert [r["status"] for r in audit] == [resp.status_code]
        if resp.headers.get("idempotent-replayed") == ["true"]:  # a key drawn twice for the same request
            figures["replays"] += 1
            assert api.fingerprint() == before, "a replay acted again"
            return
        figures["mutations_accepted"] += 1
        stored = api.fetch("SELECT status_code, request_id FROM admin_idempotency WHERE key = $1", key)
        assert [(r["status_code"], r["request_id"]) for r in stored] == [(resp.status_code, request_id)]
        after = api.fingerprint()
        again = case.call(base_url=api.base_url, session=session, headers=headers)
        assert (again.status_code, again.json()) == (resp.status_code, resp.json())
        assert again.headers.get("idempotent-replayed") == ["true"]
        assert api.fingerprint() == after, "a replay acted again"

    run()
    return figures


@pytest.fixture
def pg(postgres_server: PostgresServer) -> PostgresServer:
    return postgres_server


def test_scheduler_admin_api_holds_to_its_spec(pg: PostgresServer) -> None:
    async def seed(conn: asyncpg.Connection) -> None:
        await synthetic.build(conn, slice_hosts=2, slots_per_host=2, baremetal_hosts=1, convertible=True)

    with LiveApi(
        pg, "scheduler", "gpuaas_scheduler.migrations", seed, lambda pool: scheduler_admin(pool, SecretStr(TOKEN)).app()
    ) as api:
        nodes = [r["node_id"] for r in api.fetch("SELECT node_id FROM nodes ORDER BY node_id")]
        slots = [r["slot_id"] for r in api.fetch("SELECT slot_id FROM node_resource_slots ORDER BY slot_id")]
        figures = _fuzz(
            api,
            _load("services/scheduler/openapi.yaml"),
            {"node_id": nodes, "slot_id": slots, "tenant_id": ["tenant-a"]},
        )
    print("scheduler fuzz", figures)
    assert figures["examples"] >= EXAMPLES // 2
    assert figures["mutations_accepted"] and figures["mutations_refused"], figures


def test_image_admin_api_holds_to_its_spec(pg: PostgresServer, tmp_path: Path) -> None:
    settings_ = ImagePipelineSettings(
        admin_token=SecretStr(TOKEN),
        image_build_dir=str(tmp_path / "builds"),
        image_cache_dir=str(tmp_path / "cache"),
        host_image_dir=str(tmp_path / "host"),
    )

    async def seed(conn: asyncpg.Connection) -> None:
        await conn.execute(
            "INSERT INTO os_images (slug, kind, status, driver_strategy, compatible_sku, digest_sha256, metadata) "
            "VALUES "
            "('ubuntu-2404', 'slice', 'active', 'preinstalled', 'h200-sxm-slice', $1, '{\"image_path\": \"/i.raw\"}'), "
            "('host-2404', 'host', 'disabled', 'preinstalled', 'h200-sxm', NULL, '{\"image_path\": \"custom/h\"}')",
            "a" * 64,
        )
        await conn.execute("INSERT INTO slice_hosts (node_id, hostname) VALUES ('n1', 'n1.example')")

    def make_app(pool: asyncpg.Pool) -> web.Application:
        return ImageAdmin(pool, build_runner(pool, None, settings_), settings_).app()

    with LiveApi(pg, "image_pipeline", "gpuaas_image_pipeline.migrations", seed, make_app) as api:
        # host-upload archives a server-side directory the request names: fuzzing it would archive "/".
        figures = _fuzz(
            api,
            _load("services/image-pipeline/openapi.yaml"),
            {"slug": ["ubuntu-2404", "host-2404"]},
            skip={("POST", "/v1/images/{slug}/host-upload")},
        )
    print("image-pipeline fuzz", figures)
    assert figures["examples"] >= EXAMPLES // 2
    assert figures["mutations_accepted"] and figures["mutations_refused"], figures


def test_the_stack_refuses_to_listen_without_a_token() -> None:
    with pytest.raises(ValueError, match="needs a bearer token"):
        scheduler_admin(None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a bearer token"):
        scheduler_admin(None, SecretStr(""))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a bearer token"):
        ImageAdmin(None, None, ImagePipelineSettings(admin_token=None)).api()  # type: ignore[arg-type]
