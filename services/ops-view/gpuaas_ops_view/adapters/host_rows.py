"""The read models' tables a host's messages grow, and their cap per host held at insert time.

A host decides how many such rows there are: a flood of task reports (each naming a task of its own invention)
or of messages a service dead-letters adds rows at the host's pace. The retention sweep (gpuaas_common.retention)
prunes them by age and caps them per group, but only once an hour; the follower's transaction that inserted a
group's rows also deletes that group's oldest beyond the cap (`trim`), so no group ever holds more than the cap
past a commit, whatever a host sends between two sweeps. Both use the same cap (GPUAAS_HOST_ROWS_PER_NODE) and
the same groups (`CAPPED`).

Concurrent writers of a group (the task and report streams both write node_tasks; replicas follow the same
streams) trim under an advisory lock per group, held to their commit, each statement after the lock seeing what
the writer before it committed; the victims are taken SKIP LOCKED, so a trim never waits on a row another writer
holds (it waits on that writer's group lock, taken in one order by every writer: no deadlock). A row skipped so is
the other writer's to trim, after this one commits.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

import asyncpg

from gpuaas_common.retention import HostRows


@dataclass(frozen=True)
class Capped:
    """A table a host's messages grow. `group`: the column naming whom a row counts against; `at`: when it was
    written (the newest kept); `tiebreak`: with `at`, unique within a group, so which rows the cap keeps is exact."""

    table: str
    group: str
    at: str
    tiebreak: str

    @property
    def host_rows(self) -> HostRows:
        return HostRows(self.table, self.at, f"t.{self.group}")

    def trim_sql(self) -> str:
        # The table and columns are the constants below, never input. The edge is the newest row beyond the cap
        # (the cap's worth of the group's index walked); the victims are it and every older row of the group, an
        # index range, usually the few the batch added.
        t, g, at, tie = self.table, self.group, self.at, self.tiebreak
        return (
            f"DELETE FROM {t} WHERE ctid = ANY(ARRAY("
            "SELECT v.ctid FROM unnest($1::text[]) AS k (key) "
            f"CROSS JOIN LATERAL (SELECT e.{at} AS at, e.{tie} AS tie FROM {t} e WHERE e.{g} = k.key "
            f"ORDER BY e.{at} DESC, e.{tie} DESC OFFSET $2 LIMIT 1) edge "
            f"CROSS JOIN LATERAL (SELECT v.ctid FROM {t} v WHERE v.{g} = k.key "
            f"AND (v.{at}, v.{tie}) <= (edge.at, edge.tie) FOR UPDATE SKIP LOCKED) v))"
        )


# A node task counts against the node its first message named (the task and report streams name the same one; a
# report's node is the subject's, the authenticated part); a phase against the node that reported it; a dead
# letter against the consumer that gave up on it (hosts' own are refused: services' only).
NODE_TASKS = Capped("node_tasks", "node_id", "updated_at", "task_id")
NODE_TASK_PHASES = Capped("node_task_phases", "node_id", "at", "stream_seq")
DEAD_LETTERS = Capped("dead_letters", "consumer", "at", "dlq_seq")
CAPPED = (NODE_TASKS, NODE_TASK_PHASES, DEAD_LETTERS)
HOST_ROWS = tuple(c.host_rows for c in CAPPED)

_LOCK = (
    "SELECT count(pg_advisory_xact_lock(hashtext(l.tbl), hashtext(l.key))) FROM ("
    "SELECT g.tbl, g.key FROM unnest($1::text[], $2::text[]) AS g (tbl, key) "
    "ORDER BY hashtext(g.tbl), hashtext(g.key)) l"
)


async def trim(conn: asyncpg.Connection, grown: Mapping[Capped, Set[str]], per_group: int) -> dict[str, int]:
    """Delete, in the caller's transaction, each grown group's rows beyond its newest `per_group`; the rows deleted
    per table. Call after the transaction's last insert into these tables."""
    pairs = sorted({(c.table, key) for c, keys in grown.items() for key in keys})
    if not pairs:
        return {}
    # Its own statement: each DELETE's snapshot is then taken once the locks are held.
    await conn.fetchval(_LOCK, [p[0] for p in pairs], [p[1] for p in pairs])
    deleted: dict[str, int] = {}
    for capped in CAPPED:
        keys = sorted(grown.get(capped, ()))
        if keys:
            status = await conn.execute(capped.trim_sql(), keys, per_group)
            deleted[capped.table] = int(status.split()[-1])
    return deleted
