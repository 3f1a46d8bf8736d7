"""The console's fleet: the read model's hosts (evidence and its age, from the streams) beside the scheduler's
admin state of each node (mode, drained, maintenance, free slots: the scheduler's truth, asked of its admin API)."""

from __future__ import annotations

from typing import Any

from . import queries
from .ports import OpsReads


async def fleet(
    reads: OpsReads, query: dict[str, str | None], admin: dict[str, dict[str, Any]] | None
) -> dict[str, Any]:
    """A page of hosts, each with `admin` (the scheduler's node view, or None when it has none or could not be
    asked), and `unseen`: nodes the scheduler has that the streams have not described yet (first page only)."""
    page = await queries.list_hosts(reads, query)
    for host in page["items"]:
        host["admin"] = (admin or {}).get(host["node_id"])
    seen = {h["node_id"] for h in page["items"]}
    first = not query.get("cursor") and not query.get("node") and not query.get("kind")
    unseen = []
    if admin and first and page["next_cursor"] is None:
        unseen = [n for node_id, n in sorted(admin.items()) if node_id not in seen]
    return {**page, "unseen": unseen}
