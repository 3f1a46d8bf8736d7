"""The ops API over the read models, on the shared admin HTTP stack (gpuaas_common.admin_http: bearer auth, one
error shape, request ids, the OpenAPI document and its docs page served). Read-only: ops act through the
scheduler's and the image pipeline's admin APIs. Two principals read it: `ops` (everything) and `billing` (the
usage records only). The console's pages (entrypoints/web) are mounted on it under /console, signed in by a login
link minted from the console's own login secret, for a person and the rights they sign in with.

`services/ops-view/openapi.yaml` is rendered from `routes`:
`python -m gpuaas_ops_view.entrypoints.admin_http services/ops-view/openapi.yaml`.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
from pydantic import BaseModel, SecretStr

from gpuaas_common.admin_http import USAGE, AdminApi, Call, Route, openapi, render_yaml

from ..adapters.queries import ReadModels
from ..service_layer import queries
from . import api_models as out

if TYPE_CHECKING:
    from .web.pages import Console

SCHEMA = "ops_view"
TITLE = "gpuaas ops view API"
DESCRIPTION = (
    "Read models built from the event streams: allocations with their timeline, claims and node-task phases; the "
    "fleet's hosts with parity, topology and drift evidence and their age, slots as the bus last described them; "
    "images with each host's cache; MAAS operations; dead letters; usage records per allocation and month; the "
    "admin APIs' audit records. Lists "
    "are newest first (usage: oldest start first), `limit` (1-500, "
    "default 50) and `cursor` (the `next_cursor` of the previous page) page through them; a filter value that "
    "does not parse is a 400 naming the field. Times are ISO 8601 with a zone."
)
# What the console's refusal page tells a visitor without a session.
HOW_TO_SIGN_IN = (
    "open a link `gpuaas console` prints (minted from the console's login secret for you and your rights; valid "
    "10 minutes, and once)"
)
TIME_RANGE = ("since", "until", "limit", "cursor")
# Consumer state per stream, for /v1/streams: (pending, delivered stream seq), or None when it cannot be asked.
ConsumerState = Callable[[], Awaitable[dict[str, tuple[int, int] | None]]]


def _query(fn, model: type[BaseModel]) -> Callable[[Call], Awaitable[dict]]:
    async def handler(call: Call) -> dict:
        # Through the documented model: the answer is what the OpenAPI document says, in JSON types.
        return model.model_validate(await fn(ReadModels(call.conn), call.query)).model_dump(mode="json")

    return handler


def _one(fn, model: type[BaseModel]) -> Callable[[Call], Awaitable[dict]]:
    async def handler(call: Call) -> dict:
        return model.model_validate(await fn(ReadModels(call.conn), *call.params.values())).model_dump(mode="json")

    return handler


def routes(consumer_state: ConsumerState | None = None) -> list[Route]:
    async def streams(call: Call) -> dict[str, Any]:
        state = await consumer_state() if consumer_state is not None else {}
        return out.StreamPositions.model_validate(await queries.streams(ReadModels(call.conn), state)).model_dump(
            mode="json"
        )

    return [
        Route(
            "GET",
            "/v1/allocations",
            _query(queries.list_allocations, out.AllocationPage),
            "allocations, newest first; filters: tenant, state, node, since/until (created)",
            out.AllocationPage,
            errors=(400,),
            query=("tenant", "state", "node", *TIME_RANGE),
        ),
        Route(
            "GET",
            "/v1/allocations/{allocation_id}",
            _one(queries.get_allocation, out.AllocationDetail),
            "an allocation with its timeline, claims and node tasks with their phases",
            out.AllocationDetail,
            errors=(400,),
        ),
        Route(
            "GET",
            "/v1/hosts",
            _query(queries.list_hosts, out.HostPage),
            "hosts with their evidence and its age; filters: node, kind",
            out.HostPage,
            errors=(400,),
            query=("node", "kind", "limit", "cursor"),
        ),
        Route(
            "GET",
            "/v1/hosts/{node_id}",
            _one(queries.get_host, out.HostDetail),
            "a host, its slots (status, holder, drift) and live claims",
            out.HostDetail,
            errors=(400,),
        ),
        Route(
            "GET",
            "/v1/images",
            _one(queries.list_images, out.ImagePage),
            "images with cache states counted",
            out.ImagePage,
        ),
        Route(
            "GET",
            "/v1/images/{slug}",
            _one(queries.get_image, out.ImageDetail),
            "an image and each host's cache",
            out.ImageDetail,
            errors=(400,),
        ),
        Route(
            "GET",
            "/v1/maas/operations",
            _query(queries.list_maas, out.MaasPage),
            "MAAS operations, newest first; status=in_flight for those without a result yet; node, since/until",
            out.MaasPage,
            errors=(400,),
            query=("status", "node", *TIME_RANGE),
        ),
        Route(
            "GET",
            "/v1/dead-letters",
            _query(queries.list_dead_letters, out.DeadLetterPage),
            "dead letters, newest first, with their reasons; filters: consumer, reason_code, since/until",
            out.DeadLetterPage,
            errors=(400,),
            query=("consumer", "reason_code", *TIME_RANGE),
        ),
        Route(
            "GET",
            "/v1/usage",
            _query(queries.usage, out.UsagePage),
            "usage records of a month (month=YYYY-MM, UTC; required), oldest start first, each with its seconds "
            "inside the month (a record crossing a month boundary is split to the second), and the month's totals; "
            "filter: tenant. A record runs from the allocation's active to its released or failed; one still "
            "running counts up to as_of (default: now; the next pages of one export pass the first's)",
            out.UsagePage,
            errors=(400,),
            query=("tenant", "month", "as_of", "limit", "cursor"),
            # What the billing principal may read, and all it may.
            right=USAGE,
        ),
        Route(
            "GET",
            "/v1/audit",
            _query(queries.list_audit, out.AuditPage),
            "the admin APIs' audit records, newest first: who (actor, principal), what (method, path, status, "
            "error code), when (at), why (reason), which request (request_id, idempotency_key); filters: actor, "
            "service, request_id, since/until",
            out.AuditPage,
            errors=(400,),
            query=("actor", "service", "request_id", *TIME_RANGE),
        ),
        Route(
            "GET",
            "/v1/streams",
            streams,
            "how far the models have read each stream",
            out.StreamPositions,
        ),
    ]


def openapi_document() -> dict[str, Any]:
    return openapi(routes(), title=TITLE, version="1", description=DESCRIPTION)


def ops_api(
    pool: asyncpg.Pool,
    token: SecretStr,
    consumer_state: ConsumerState,
    console: Console | None = None,
    *,
    billing_token: SecretStr | None = None,
    login_secret: SecretStr | None = None,
) -> AdminApi:
    """`token`: the `ops` principal's; `billing_token`: the `billing` principal's (usage only); `login_secret`:
    the console's login links' key (no link signs in without one)."""
    return AdminApi(
        service="ops-view",
        schema=SCHEMA,
        pool=pool,
        tokens={"ops": token, "billing": billing_token},
        routes=routes(consumer_state),
        document=openapi_document,
        pages=console.pages(HOW_TO_SIGN_IN, login_secret) if console is not None else None,
    )


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(render_yaml(openapi_document()))
