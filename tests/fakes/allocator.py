"""The allocator's repositories in dicts (gpuaas_allocator.service_layer.ports): `FakeAllocationRepository` is
one unit of work's `repos`, as adapters.repository.AllocationRepository is on Postgres."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from gpuaas_allocator.adapters.repository import AllocationStore
from gpuaas_allocator.domain.model import ActiveImage

# What a new row holds in the columns no insert names (the migrations' defaults).
_DEFAULTS: dict[str, Any] = {
    "node_id": None,
    "maas_system_id": None,
    "placement": None,
    "task_id": None,
    "release_task_id": None,
    "operation_id": None,
    "release_operation_id": None,
    "awaiting_result": False,
    "deployed": False,
    "enrolled": False,
    "access": None,
    "phase_marks": None,
    "task_deadline_at": None,
    "timed_out_task_id": None,
    "placement_asks": 0,
    "failure_code": None,
    "failure_reason": None,
    "task_reasked_at": None,
    "host_notes": 0,
}


def _now() -> datetime:
    return datetime.now(timezone.utc)


class FakeTerminalSessions:
    """The terminal's audit rows (ports.TerminalSessions), over the allocations `allocations()` returns."""

    def __init__(self, allocations: Callable[[], dict[uuid.UUID, dict[str, Any]]]) -> None:
        self._allocations = allocations
        self.sessions: dict[uuid.UUID, dict[str, Any]] = {}

    async def lock_allocation(self, allocation_id: uuid.UUID) -> dict[str, Any] | None:
        row = self._allocations().get(allocation_id)
        if row is None:
            return None
        return {k: row[k] for k in ("allocation_id", "tenant_id", "shape", "state", "node_id")}

    async def lock_tenant(self, tenant_id: str) -> None:
        """One process, one event loop: nothing to serialise."""

    def _live(self, tenant_id: str) -> list[dict[str, Any]]:
        return [s for s in self.sessions.values() if s["tenant_id"] == tenant_id and s["ended_at"] is None]

    async def end_stale_sessions(self, tenant_id: str, stale_after_s: float) -> int:
        stale = [s for s in self._live(tenant_id) if s["seen_at"] < _now() - timedelta(seconds=stale_after_s)]
        for s in stale:
            s.update(ended_at=_now(), end_reason="replica_gone")
        return len(stale)

    async def live_counts(self, tenant_id: str, allocation_id: uuid.UUID) -> tuple[int, int]:
        live = self._live(tenant_id)
        return sum(1 for s in live if s["allocation_id"] == allocation_id), len(live)

    async def insert_session(
        self,
        *,
        session_id: uuid.UUID,
        allocation_id: uuid.UUID,
        tenant_id: str,
        actor: str,
        node_id: str,
        task_id: str,
        replica_id: str,
    ) -> None:
        if allocation_id not in self._allocations():
            raise KeyError(f"no allocation {allocation_id}")  # the table's foreign key
        now = _now()
        self.sessions[session_id] = {
            "session_id": session_id,
            "allocation_id": allocation_id,
            "tenant_id": tenant_id,
            "actor": actor,
            "node_id": node_id,
            "task_id": task_id,
            "replica_id": replica_id,
            "started_at": now,
            "seen_at": now,
            "ended_at": None,
            "end_reason": None,
            "bytes_to_guest": 0,
            "bytes_from_guest": 0,
        }

    async def renew_claims(self, session_ids: list[uuid.UUID]) -> None:
        for session_id in session_ids:
            s = self.sessions.get(session_id)
            if s is not None and s["ended_at"] is None:
                s["seen_at"] = _now()

    async def end_session(
        self, session_id: uuid.UUID, *, reason: str, bytes_to_guest: int, bytes_from_guest: int
    ) -> bool:
        s = self.sessions.get(session_id)
        if s is None or s["ended_at"] is not None:
            return False
        s.update(ended_at=_now(), end_reason=reason, bytes_to_guest=bytes_to_guest, bytes_from_guest=bytes_from_guest)
        return True


class FakeAllocationRepository(AllocationStore):
    """Same surface as adapters.repository.AllocationRepository (ports.AllocatorRepositories), in dicts; knows
    `images` as active from the start."""

    def __init__(self, *images: ActiveImage) -> None:
        self.allocations: dict[uuid.UUID, dict[str, Any]] = {}
        self.timeline: list[tuple[uuid.UUID, str]] = []
        self.entries: list[dict[str, Any]] = []  # the timeline rows in full
        self.images = {i.slug: i for i in images}
        self.image_clock: dict[str, datetime] = {}
        self.early: dict[tuple[uuid.UUID, str], dict[str, Any]] = {}
        self.terminal = FakeTerminalSessions(lambda: self.allocations)

    async def lock(self, allocation_id: uuid.UUID) -> dict[str, Any] | None:
        row = self.allocations.get(allocation_id)
        return copy.deepcopy(row) if row else None

    def last_seq(self, allocation_id: uuid.UUID) -> int:
        return sum(1 for a, _s in self.timeline if a == allocation_id)

    async def insert(self, **fields: Any) -> None:
        now = _now()
        row = {**_DEFAULTS, "created_at": now, "updated_at": now}
        row.update(copy.deepcopy(fields))
        self.allocations[fields["allocation_id"]] = row

    async def update(self, allocation_id: uuid.UUID, **fields: Any) -> None:
        self.allocations[allocation_id].update(copy.deepcopy(fields), updated_at=_now())

    async def append_timeline(
        self, allocation_id: uuid.UUID, state: str, previous_state: str | None, **fields: Any
    ) -> int:
        self.timeline.append((allocation_id, state))
        self.entries.append(
            {"allocation_id": allocation_id, "state": state, "previous_state": previous_state, **fields}
        )
        return sum(1 for a, _s in self.timeline if a == allocation_id)

    async def lock_machine_holders(self, node_id: str) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(r)
            for r in sorted(self.allocations.values(), key=lambda r: r["created_at"])
            if r["shape"] == "baremetal"
            and r["node_id"] == node_id
            and r["operation_id"] is not None
            and (
                r["state"] in ("provisioning", "active", "releasing")
                or (r["state"] == "failed" and (r["release_operation_id"] is None or r["awaiting_result"]))
            )
        ]

    async def accepted_seq(self, allocation_id: uuid.UUID) -> int | None:
        mine = [state for a, state in self.timeline if a == allocation_id]
        return mine.index("accepted") + 1 if "accepted" in mine else None

    # --- the sweeps' due rows ---------------------------------------------------------------------

    def _due(self, wanted: Callable[[dict[str, Any]], bool], order_by: str, limit: int) -> list[dict[str, Any]]:
        rows = [copy.deepcopy(r) for r in self.allocations.values() if wanted(r)]
        return sorted(rows, key=lambda r: r[order_by])[:limit]

    @staticmethod
    def _idle_for(row: dict[str, Any], after_s: float) -> bool:
        return bool(row["updated_at"] + timedelta(seconds=after_s) < _now())

    async def lock_overdue(self, grace_s: float, limit: int) -> list[dict[str, Any]]:
        now = _now()
        return self._due(
            lambda r: (
                r["awaiting_result"]
                and r["task_deadline_at"] is not None
                and (r["state"] in ("provisioning", "releasing") or (r["state"] == "failed" and r["release_task_id"]))
                and r["task_deadline_at"] + timedelta(seconds=grace_s) < now
            ),
            "task_deadline_at",
            limit,
        )

    async def lock_awaiting_maas(self, after_s: float, limit: int) -> list[dict[str, Any]]:
        return self._due(
            lambda r: (
                r["shape"] == "baremetal"
                and r["awaiting_result"]
                and (
                    r["state"] in ("provisioning", "releasing")
                    or (r["state"] == "failed" and r["release_operation_id"] is not None)
                )
                and (r["release_operation_id"] or r["operation_id"]) is not None
                and self._idle_for(r, after_s)
            ),
            "updated_at",
            limit,
        )

    async def lock_awaiting_enrolment(self, after_s: float, limit: int) -> list[dict[str, Any]]:
        return self._due(
            lambda r: (
                r["shape"] == "baremetal"
                and r["state"] == "provisioning"
                and r["deployed"]
                and not r["enrolled"]
                and not r["awaiting_result"]
                and self._idle_for(r, after_s)
            ),
            "updated_at",
            limit,
        )

    async def lock_awaiting_placement(self, after_s: float, limit: int) -> list[dict[str, Any]]:
        return self._due(
            lambda r: r["node_id"] is None and r["state"] in ("accepted", "releasing") and self._idle_for(r, after_s),
            "updated_at",
            limit,
        )

    # --- early task results -----------------------------------------------------------------------

    async def keep_early_result(
        self, allocation_id: uuid.UUID, task_id: str, node_id: str, result: Any, event_id: str
    ) -> bool:
        if (allocation_id, task_id) in self.early:
            return False
        self.early[(allocation_id, task_id)] = {"node_id": node_id, "result": copy.deepcopy(result)}
        return True

    async def take_early_result(self, allocation_id: uuid.UUID, task_id: str) -> dict[str, Any] | None:
        return self.early.pop((allocation_id, task_id), None)

    # --- the image catalog ------------------------------------------------------------------------

    async def get_image(self, slug: str) -> ActiveImage | None:
        return self.images.get(slug)

    async def upsert_image(self, image: ActiveImage) -> None:
        self.images[image.slug] = image

    async def delete_image(self, slug: str) -> None:
        self.images.pop(slug, None)

    async def advance_image_clock(self, slug: str, occurred_at: datetime) -> bool:
        # Never later than now, as Postgres keeps it: one event dated in the future must not freeze the slug.
        at = min(occurred_at, _now())
        if slug in self.image_clock and self.image_clock[slug] >= at:
            return False
        self.image_clock[slug] = at
        return True
