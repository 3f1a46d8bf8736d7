"""Host-local durable state (sqlite): task records, fencing epochs and resource leases.

It survives an agent restart, so a redelivered task is answered from its record instead of being
run twice, and a task a killed agent left running is resumed from its stored payload (whether it had
touched a disk decides whether, when it cannot resume, the agent must wipe that disk itself).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuaas_common.contract import TaskType

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id       TEXT PRIMARY KEY,
    task_type     TEXT NOT NULL,
    allocation_id TEXT NOT NULL,
    status        TEXT NOT NULL,
    phase         TEXT,
    disk_touched  INTEGER NOT NULL DEFAULT 0,
    result_json   TEXT,
    updated_at    REAL NOT NULL,
    vm_name       TEXT,
    payload_json  TEXT
);
CREATE TABLE IF NOT EXISTS slot_epochs (
    slot_id TEXT PRIMARY KEY,
    epoch   INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    resource      TEXT PRIMARY KEY,
    allocation_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS task_askers (
    task_id    TEXT PRIMARY KEY,
    message_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS vfio_binding (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    task_id    TEXT NOT NULL,
    action     TEXT NOT NULL,
    slots_json TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS verified_images (
    path   TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    size   INTEGER NOT NULL,
    mtime  REAL NOT NULL
);
"""


class StateStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(tasks)")}
        # State written by an older agent: add what recovery needs, keep the records.
        for column in ("vm_name", "payload_json"):
            if column not in columns:
                self._db.execute(f"ALTER TABLE tasks ADD COLUMN {column} TEXT")
        binding = {row[1] for row in self._db.execute("PRAGMA table_info(vfio_binding)")}
        if "action" not in binding:  # kept by an agent of this change's first commit, before releases were told apart
            self._db.execute("ALTER TABLE vfio_binding ADD COLUMN action TEXT NOT NULL DEFAULT 'bind'")

    def close(self) -> None:
        self._db.close()

    # --- tasks ---------------------------------------------------------------------------------

    def task(self, task_id: str) -> dict[str, Any] | None:
        row = self._db.execute(
            "SELECT task_id, task_type, allocation_id, status, phase, disk_touched, result_json FROM tasks "
            "WHERE task_id = ?",
            (task_id,),
        ).fetchone()
        if row is None:
            return None
        keys = ("task_id", "task_type", "allocation_id", "status", "phase", "disk_touched", "result_json")
        record = dict(zip(keys, row, strict=True))
        record["result"] = json.loads(record.pop("result_json")) if record["result_json"] else None
        return record

    def start_task(
        self,
        task_id: str,
        task_type: str,
        allocation_id: str,
        *,
        vm_name: str | None = None,
        payload: dict[str, Any] | None = None,
    ) -> None:
        self._db.execute(
            "INSERT INTO tasks (task_id, task_type, allocation_id, status, updated_at, vm_name, payload_json) "
            "VALUES (?, ?, ?, 'running', ?, ?, ?) "
            "ON CONFLICT (task_id) DO UPDATE SET status = 'running', updated_at = excluded.updated_at",
            (task_id, task_type, allocation_id, time.time(), vm_name, json.dumps(payload) if payload else None),
        )

    def first_asker(self, task_id: str, message_id: str) -> str:
        """The id of the first message that asked for this task (recorded now if this is the first)."""
        self._db.execute(
            "INSERT INTO task_askers (task_id, message_id) VALUES (?, ?) ON CONFLICT (task_id) DO NOTHING",
            (task_id, message_id),
        )
        row = self._db.execute("SELECT message_id FROM task_askers WHERE task_id = ?", (task_id,)).fetchone()
        return str(row[0])

    def running_tasks(self) -> list[dict[str, Any]]:
        """Tasks a previous run of the agent started and never finished, oldest first, with their payloads."""
        rows = self._db.execute(
            "SELECT task_id, task_type, payload_json, disk_touched FROM tasks WHERE status = 'running' "
            "ORDER BY updated_at"
        ).fetchall()
        return [
            {
                "task_id": r[0],
                "task_type": r[1],
                "payload": json.loads(r[2]) if r[2] else None,
                "disk_touched": bool(r[3]),
            }
            for r in rows
        ]

    def latest_by_vm(self) -> dict[str, tuple[str, str]]:
        """vm_name → (task_type, status) of the most recent task for that VM."""
        rows = self._db.execute(
            "SELECT vm_name, task_type, status FROM tasks WHERE vm_name IS NOT NULL ORDER BY updated_at, rowid"
        ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def live_allocations(self) -> set[str]:
        """Allocations whose latest task is a running or succeeded provision, or an unfinished release."""
        rows = self._db.execute(
            "SELECT allocation_id, task_type, status FROM tasks ORDER BY updated_at, rowid"
        ).fetchall()
        latest = {r[0]: (r[1], r[2]) for r in rows}
        return {
            a
            for a, (t, s) in latest.items()
            if (t == TaskType.SLICE_VM_PROVISION and s in ("running", "succeeded"))
            or (t == TaskType.SLICE_VM_RELEASE and s != "succeeded")
        }

    def running_guest(self, allocation_id: str) -> dict[str, Any] | None:
        """The provision task (vm_name, payload) behind an allocation's guest, when the allocation's latest task is
        that provision and it succeeded: the one record a terminal may take its target from."""
        row = self._db.execute(
            "SELECT task_type, status, vm_name, payload_json FROM tasks WHERE allocation_id = ? "
            "ORDER BY updated_at DESC, rowid DESC LIMIT 1",
            (allocation_id,),
        ).fetchone()
        if row is None or row[0] != TaskType.SLICE_VM_PROVISION or row[1] != "succeeded" or not row[2] or not row[3]:
            return None
        return {"vm_name": row[2], "payload": json.loads(row[3])}

    # --- VFIO binding -------------------------------------------------------------------------------

    def approved_slots(self) -> list[dict[str, Any]]:
        """The approved slots of the last binding the scheduler asked for and the host applied (slice.vfio_apply):
        the only set parity's `vfio_binding` takes as approved. Empty before the first, and after leaving."""
        row = self._db.execute("SELECT slots_json FROM vfio_binding WHERE id = 1").fetchone()
        return list(json.loads(row[0])) if row else []

    def binding_released(self) -> bool:
        """Whether the last binding applied was a release (leaving slice mode)."""
        row = self._db.execute("SELECT action FROM vfio_binding WHERE id = 1").fetchone()
        return bool(row and row[0] == "unbind")

    def set_approved_slots(self, task_id: str, action: str, slots: list[dict[str, Any]]) -> None:
        self._db.execute(
            "INSERT INTO vfio_binding (id, task_id, action, slots_json, updated_at) VALUES (1, ?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET task_id = excluded.task_id, action = excluded.action, "
            "slots_json = excluded.slots_json, updated_at = excluded.updated_at",
            (task_id, action, json.dumps(slots), time.time()),
        )

    def slot_records(self) -> dict[str, dict[str, Any]]:
        """slot_id → the latest task that named the slot: its binding (as the task carried it), task type,
        status, VM and allocation. Tasks on one slot never interleave, so the latest update is the latest task."""
        rows = self._db.execute(
            "SELECT task_type, status, vm_name, allocation_id, payload_json FROM tasks "
            "WHERE payload_json IS NOT NULL ORDER BY updated_at, rowid"
        ).fetchall()
        out: dict[str, dict[str, Any]] = {}
        for task_type, status, vm_name, allocation_id, payload in rows:
            for binding in json.loads(payload).get("slots") or []:
                out[binding["slot_id"]] = {
                    "binding": binding,
                    "task_type": task_type,
                    "status": status,
                    "vm_name": vm_name,
                    "allocation_id": allocation_id,
                }
        return out

    def set_phase(self, task_id: str, phase: str, *, disk_touched: bool = False) -> None:
        self._db.execute(
            "UPDATE tasks SET phase = ?, disk_touched = MAX(disk_touched, ?), updated_at = ? WHERE task_id = ?",
            (phase, int(disk_touched), time.time(), task_id),
        )

    def finish_task(self, task_id: str, status: str, result: dict[str, Any]) -> None:
        self._db.execute(
            "UPDATE tasks SET status = ?, result_json = ?, updated_at = ? WHERE task_id = ?",
            (status, json.dumps(result), time.time(), task_id),
        )

    # --- fencing ----------------------------------------------------------------------------------

    def check_and_record_epochs(self, slot_ids: list[str], epoch: int) -> str | None:
        """Refuse an epoch older than one already seen for any slot; otherwise remember it."""
        with self._immediate():
            for slot_id in slot_ids:
                row = self._db.execute("SELECT epoch FROM slot_epochs WHERE slot_id = ?", (slot_id,)).fetchone()
                if row is not None and row[0] > epoch:
                    return f"slot {slot_id} is fenced at epoch {row[0]}, task carries {epoch}"
            for slot_id in slot_ids:
                self._db.execute(
                    "INSERT INTO slot_epochs (slot_id, epoch) VALUES (?, ?) "
                    "ON CONFLICT (slot_id) DO UPDATE SET epoch = MAX(epoch, excluded.epoch)",
                    (slot_id, epoch),
                )
        return None

    @contextlib.contextmanager
    def _immediate(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # --- leases ------------------------------------------------------------------------------------

    def take_leases(self, resources: list[str], allocation_id: str) -> str | None:
        with self._immediate():
            for res in resources:
                row = self._db.execute("SELECT allocation_id FROM leases WHERE resource = ?", (res,)).fetchone()
                if row is not None and row[0] != allocation_id:
                    return f"{res} is leased by allocation {row[0]}"
            self._db.executemany(
                "INSERT OR IGNORE INTO leases (resource, allocation_id) VALUES (?, ?)",
                [(res, allocation_id) for res in resources],
            )
        return None

    def holds_leases(self, allocation_id: str, resources: list[str]) -> bool:
        """Whether `allocation_id` holds every one of `resources` (and so nothing newer took them)."""
        if not resources:
            return False
        held = self._db.execute(
            f"SELECT count(*) FROM leases WHERE allocation_id = ? AND resource IN ({', '.join('?' * len(resources))})",
            (allocation_id, *resources),
        ).fetchone()[0]
        return held == len(set(resources))

    def leased_resources(self) -> dict[str, str]:
        return dict(self._db.execute("SELECT resource, allocation_id FROM leases").fetchall())

    def drop_leases(self, allocation_id: str) -> None:
        self._db.execute("DELETE FROM leases WHERE allocation_id = ?", (allocation_id,))

    # --- image verification cache ------------------------------------------------------------------

    def verified_digest(self, path: str, size: int, mtime: float) -> str | None:
        row = self._db.execute(
            "SELECT digest FROM verified_images WHERE path = ? AND size = ? AND mtime = ?", (path, size, mtime)
        ).fetchone()
        return row[0] if row else None

    def remember_digest(self, path: str, digest: str, size: int, mtime: float) -> None:
        self._db.execute(
            "INSERT INTO verified_images (path, digest, size, mtime) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (path) DO UPDATE SET digest = excluded.digest, size = excluded.size, mtime = excluded.mtime",
            (path, digest, size, mtime),
        )
