"""Query filters of the ops API as values, or the one field that does not parse (answered 400 naming it)."""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from dataclasses import dataclass
from datetime import datetime

from gpuaas_common.contract import AllocationState

from .usage import month_bounds

IDENTIFIER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
SLUG = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
# Who acted, as the admin APIs take it (X-Actor, a login link's name): an identifier that may hold an @.
ACTOR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
AUDITED_SERVICES = ("scheduler", "image-pipeline")
# The states lifecycle events carry (not `requested`: it never leaves the allocator), and the read model's own
# `rejected` (an allocation.rejected: refused before it was ever accepted).
ALLOCATION_STATES: tuple[str, ...] = (*(s for s in AllocationState if s != AllocationState.REQUESTED), "rejected")
DEFAULT_LIMIT, MAX_LIMIT = 50, 500


class FilterError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Page:
    limit: int
    # Keyset: the sort key of the last row of the previous page; None for the first page.
    after: tuple[str, str] | None


@dataclass(frozen=True)
class AllocationFilter:
    tenant: str | None
    state: str | None
    node: str | None
    since: datetime | None
    until: datetime | None
    page: Page


def identifier(field: str, value: str | None) -> str | None:
    if value is None or value == "":
        return None
    if not IDENTIFIER.match(value):
        raise FilterError(field, "must be an identifier: letters, digits and ._:- (at most 128)")
    return value


def actor(field: str, value: str | None) -> str | None:
    if value is None or value == "":
        return None
    if not ACTOR.match(value):
        raise FilterError(field, "must be an actor name: letters, digits and ._:@- (at most 128)")
    return value


def one_of(field: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is None or value == "":
        return None
    if value not in allowed:
        raise FilterError(field, f"must be one of {', '.join(allowed)}")
    return value


def timestamp(field: str, value: str | None) -> datetime | None:
    """ISO 8601 with a zone (`2026-11-01T00:00:00Z`): a time without one names no instant."""
    if value is None or value == "":
        return None
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00").replace(" ", "+"))
    except ValueError:
        raise FilterError(field, "must be an ISO 8601 time with a zone, e.g. 2026-11-01T00:00:00Z") from None
    if at.tzinfo is None:
        raise FilterError(field, "must carry a zone (Z or +hh:mm)")
    return at


def month(field: str, value: str | None) -> tuple[datetime, datetime]:
    """A required `YYYY-MM` (UTC) as its half-open interval."""
    if value is None or value == "":
        raise FilterError(field, "is required: a month as YYYY-MM, e.g. 2026-11")
    try:
        return month_bounds(value)
    except ValueError as exc:
        raise FilterError(field, str(exc)) from None


def allocation_id(field: str, value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise FilterError(field, "must be a UUID") from None


def page(limit: str | None, cursor: str | None) -> Page:
    count = DEFAULT_LIMIT
    if limit not in (None, ""):
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIMIT:
            raise FilterError("limit", f"must be a whole number from 1 to {MAX_LIMIT}")
        count = int(limit)
    return Page(count, decode_cursor(cursor))


def time_range(since: str | None, until: str | None) -> tuple[datetime | None, datetime | None]:
    start, end = timestamp("since", since), timestamp("until", until)
    if start is not None and end is not None and end < start:
        raise FilterError("until", "is before since")
    return start, end


def allocation_filter(query: dict[str, str | None]) -> AllocationFilter:
    since, until = time_range(query.get("since"), query.get("until"))
    return AllocationFilter(
        tenant=identifier("tenant", query.get("tenant")),
        state=one_of("state", query.get("state"), ALLOCATION_STATES),
        node=identifier("node", query.get("node")),
        since=since,
        until=until,
        page=page(query.get("limit"), query.get("cursor")),
    )


def encode_cursor(sort_key: str, row_id: str) -> str:
    return base64.urlsafe_b64encode(f"{sort_key}\n{row_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> tuple[str, str] | None:
    if cursor is None or cursor == "":
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        sort_key, row_id = raw.split("\n", 1)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise FilterError("cursor", "is not a cursor this API returned") from None
    return sort_key, row_id
