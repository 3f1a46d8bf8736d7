"""The ops API's reads: one request in, the read models' answer out (filters parsed by domain/filters.py), read
through the `OpsReads` port (adapters/queries.py's `ReadModels` on the request's connection)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from gpuaas_common.api_error import ApiError

from ..domain import filters as f
from ..domain.models import evidence_age, slot_view_status
from ..domain.usage import seconds_within, to_the_second, whole_seconds
from .ports import OpsReads


def _bad(exc: f.FilterError) -> ApiError:
    return ApiError(400, "invalid_filter", f"{exc.field} {exc.message}", {"field": exc.field})


def _paged(rows: list[dict[str, Any]], page: f.Page, key: Any) -> dict[str, Any]:
    more = len(rows) > page.limit
    items = rows[: page.limit]
    return {"items": items, "next_cursor": f.encode_cursor(*key(items[-1])) if more and items else None}


async def list_allocations(reads: OpsReads, query: dict[str, str | None]) -> dict[str, Any]:
    try:
        flt = f.allocation_filter(query)
        if flt.page.after is not None:
            f.timestamp("cursor", flt.page.after[0])
            f.allocation_id("cursor", flt.page.after[1])
    except f.FilterError as exc:
        raise _bad(exc) from None
    rows = await reads.list_allocations(flt)
    return _paged(rows, flt.page, lambda r: (r["created_at"].isoformat(), str(r["allocation_id"])))


async def get_allocation(reads: OpsReads, allocation_id: str) -> dict[str, Any]:
    try:
        key = f.allocation_id("allocation_id", allocation_id)
    except f.FilterError as exc:
        raise _bad(exc) from None
    row = await reads.allocation(key)
    if row is None:
        raise ApiError(404, "not_found", f"no allocation {allocation_id} in the read model")
    return {
        **row,
        "timeline": await reads.timeline(key),
        "claims": await reads.claims(allocation_id=key),
        "tasks": await reads.tasks(key),
    }


def _host_view(row: dict[str, Any], now: datetime) -> dict[str, Any]:
    age = evidence_age(now, row.get("parity_checked_at"), row.get("topology_at"), row.get("drift_checked_at"))
    return {
        **row,
        "drift_open": len(row.get("drift") or []),
        "evidence_age_s": {"parity": age.parity_s, "topology": age.topology_s, "drift": age.drift_s},
    }


async def list_hosts(reads: OpsReads, query: dict[str, str | None]) -> dict[str, Any]:
    try:
        node = f.identifier("node", query.get("node"))
        kind = f.one_of("kind", query.get("kind"), ("slice_host", "baremetal"))
        page = f.page(query.get("limit"), query.get("cursor"))
    except f.FilterError as exc:
        raise _bad(exc) from None
    now = datetime.now(timezone.utc)
    rows = [_host_view(r, now) for r in await reads.list_hosts(node, kind, page)]
    return _paged(rows, page, lambda r: ("", r["node_id"]))


async def get_host(reads: OpsReads, node_id: str) -> dict[str, Any]:
    try:
        f.identifier("node_id", node_id)
    except f.FilterError as exc:
        raise _bad(exc) from None
    row = await reads.host(node_id)
    claims = await reads.claims(node_id=node_id)
    if row is None and not claims:
        raise ApiError(404, "not_found", f"no host {node_id} in the read model")
    view = _host_view(row or await reads.unknown_host(node_id), datetime.now(timezone.utc))
    drifted: dict[str, list[str]] = {}
    for d in view.get("drift") or []:
        for slot_id in d.get("slot_ids", []):
            drifted.setdefault(slot_id, []).append(d["kind"])
    slots = []
    for slot in await reads.slots(node_id):
        mine = [c for c in claims if c["slot_id"] == slot["slot_id"]]
        forced_live = any(c["forced_by"] and c["released_at"] is None for c in mine)
        holder = next((c["allocation_id"] for c in mine if c["released_at"] is None), None)
        status = (
            "cleanup_blocked" if forced_live else slot_view_status(mine, slot["announced_status"], slot["announced_at"])
        )
        slots.append({**slot, "status": status, "held_by": holder, "drift": drifted.get(slot["slot_id"], [])})
    history = await reads.mode_history(node_id)
    live = [c for c in claims if c["released_at"] is None]
    return {**view, "slots": slots, "claims": live, "mode_history": history, "tasks": await reads.host_tasks(node_id)}


async def list_images(reads: OpsReads) -> dict[str, Any]:
    return {"items": await reads.list_images(), "next_cursor": None}


async def get_image(reads: OpsReads, slug: str) -> dict[str, Any]:
    if not f.SLUG.match(slug):
        raise _bad(f.FilterError("slug", "must be an image slug: a-z, 0-9 and ._-"))
    row = await reads.image(slug)
    if row is None:
        raise ApiError(404, "not_found", f"no image {slug} in the read model")
    return {**row, "caches": await reads.image_caches(slug)}


async def list_maas(reads: OpsReads, query: dict[str, str | None]) -> dict[str, Any]:
    try:
        status = f.one_of(
            "status", query.get("status"), ("in_flight", "requested", "deployed", "released", "succeeded", "failed")
        )
        node = f.identifier("node", query.get("node"))
        since, until = f.time_range(query.get("since"), query.get("until"))
        page = f.page(query.get("limit"), query.get("cursor"))
        if page.after is not None:
            f.timestamp("cursor", page.after[0])
    except f.FilterError as exc:
        raise _bad(exc) from None
    rows = await reads.list_maas(status, node, since, until, page)
    return _paged(rows, page, lambda r: (r["updated_at"].isoformat(), r["operation_id"]))


async def list_dead_letters(reads: OpsReads, query: dict[str, str | None]) -> dict[str, Any]:
    try:
        consumer = f.identifier("consumer", query.get("consumer"))
        reason_code = f.identifier("reason_code", query.get("reason_code"))
        since, until = f.time_range(query.get("since"), query.get("until"))
        page = f.page(query.get("limit"), query.get("cursor"))
        if page.after is not None and not page.after[1].isdigit():
            raise f.FilterError("cursor", "is not a cursor this API returned")
    except f.FilterError as exc:
        raise _bad(exc) from None
    rows = await reads.list_dead_letters(consumer, reason_code, since, until, page)
    return _paged(rows, page, lambda r: ("", str(r["dlq_seq"])))


async def usage(reads: OpsReads, query: dict[str, str | None]) -> dict[str, Any]:
    """A month's usage records (UTC; domain/usage.py has the rule), oldest start first, each with its seconds
    inside the month, and the month's totals over every record (not only this page). A record still running is
    counted up to `as_of` (the time of the answer unless given: the pages of one export give the first's) and
    marked open."""
    try:
        tenant = f.identifier("tenant", query.get("tenant"))
        month = query.get("month") or ""
        since, until = f.month("month", month)
        page = f.page(query.get("limit"), query.get("cursor"))
        if page.after is not None:
            f.timestamp("cursor", page.after[0])
            f.allocation_id("cursor", page.after[1])
        as_of = f.timestamp("as_of", query.get("as_of"))
    except f.FilterError as exc:
        raise _bad(exc) from None
    now = to_the_second(as_of or datetime.now(timezone.utc))
    rows = await reads.list_usage(tenant, since, until, now, page)
    items = []
    for r in rows:
        stopped = r["stopped_at"] if r["stopped_at"] is not None else max(now, r["started_at"])
        seconds = seconds_within(r["started_at"], stopped, since, until)
        items.append(
            {
                **r,
                "open": r["stopped_at"] is None,
                "seconds": seconds,
                "gpu_seconds": seconds * r["gpu_count"] if r["gpu_count"] is not None else None,
                "record_seconds": whole_seconds(stopped - r["started_at"]),
            }
        )
    paged = _paged(items, page, lambda r: (r["started_at"].isoformat(), str(r["allocation_id"])))
    totals = await reads.usage_totals(tenant, since, until, now)
    return {"month": month, "tenant": tenant, "since": since, "until": until, "as_of": now, "totals": totals, **paged}


async def list_audit(reads: OpsReads, query: dict[str, str | None]) -> dict[str, Any]:
    """The admin APIs' audit records, newest first: who, what, when, why, which request."""
    try:
        actor = f.actor("actor", query.get("actor"))
        service = f.one_of("service", query.get("service"), f.AUDITED_SERVICES)
        request_id = f.identifier("request_id", query.get("request_id"))
        since, until = f.time_range(query.get("since"), query.get("until"))
        page = f.page(query.get("limit"), query.get("cursor"))
        if page.after is not None:
            f.timestamp("cursor", page.after[0])
    except f.FilterError as exc:
        raise _bad(exc) from None
    rows = await reads.list_audit(actor, service, request_id, since, until, page)
    return _paged(rows, page, lambda r: (r["at"].isoformat(), r["event_id"]))


async def streams(reads: OpsReads, consumers: dict[str, tuple[int, int] | None]) -> dict[str, Any]:
    """Each followed stream: the sequence the models committed, and what its consumer says (messages still to
    deliver, the last sequence delivered; None when the consumer could not be asked). Caught up: nothing pending
    and everything delivered committed."""
    have = await reads.positions()
    items = []
    for stream, seen in sorted(consumers.items()):
        position = have.get(stream, {"last_seq": 0})["last_seq"]
        pending, delivered = seen if seen is not None else (None, None)
        caught_up = None if seen is None else pending == 0 and position >= delivered
        items.append(
            {
                "stream": stream,
                "position": position,
                "pending": pending,
                "delivered_seq": delivered,
                "caught_up": caught_up,
            }
        )
    return {"items": items, "next_cursor": None}
