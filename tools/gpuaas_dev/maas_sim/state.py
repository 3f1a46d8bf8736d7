"""Everything one simulator instance remembers: machines, tags, keys, faults and call counts."""

from __future__ import annotations

import asyncio
import base64
from collections import Counter, defaultdict
from typing import Any

from .auth import OAuthVerifier
from .config import SimConfig
from .errors import NotFound
from .faults import FaultBook
from .machines import Machine, Timers
from .resources import BootResourceStore, ScriptStore
from .script_results import ResultStore

API_ROOT = "/MAAS/api/2.0/"


class SimState:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.timers: Timers = config.timers
        self.machines: dict[str, Machine] = {}
        self.tags: dict[str, dict[str, Any]] = {}
        self.boot_resources = BootResourceStore()
        self.scripts = ScriptStore()
        self.results = ResultStore()
        for index, spec in enumerate(config.machine_specs(), start=1):
            system_id = spec.resolved_system_id
            if system_id in self.machines:
                raise ValueError(f"duplicate system_id {system_id} ({spec.hostname})")
            self.machines[system_id] = Machine(
                system_id=system_id,
                hostname=spec.hostname,
                index=index,
                tags=set(spec.tags),
                secure_erase_supported=spec.secure_erase,
            )
            for tag in spec.tags:
                self.ensure_tag(tag)
        self.verifier = OAuthVerifier([config.key], wall_clock=config.wall_clock)
        self.faults = FaultBook(config.seed)
        self.calls: defaultdict[str, Counter[str]] = defaultdict(Counter)
        # HTTP status of every answer that was sent, per operation (a dropped response has none).
        self.responses: defaultdict[str, Counter[int]] = defaultdict(Counter)
        # Set when the server shuts down, so responses held back by a fault are let go promptly.
        self.shutting_down = asyncio.Event()
        # Power drivers' steps in flight (power.py), held so none is collected before it ends.
        self.power_tasks: set[asyncio.Task[None]] = set()

    def now(self) -> float:
        return self.config.clock()

    def advance(self) -> None:
        now = self.now()
        for machine in self.machines.values():
            machine.advance(now, self.timers)

    def machine(self, system_id: str) -> Machine:
        machine = self.machines.get(system_id)
        if machine is None:
            raise NotFound("No Machine matches the given query.")
        machine.advance(self.now(), self.timers)
        return machine

    def ensure_tag(self, name: str, definition: str = "", comment: str = "", kernel_opts: str = "") -> dict[str, Any]:
        return self.tags.setdefault(
            name,
            {
                "name": name,
                "definition": definition,
                "comment": comment,
                "kernel_opts": kernel_opts,
                "resource_uri": f"{API_ROOT}tags/{name}/",
            },
        )

    def record_call(self, op: str, system_id: str | None) -> None:
        self.calls[op][system_id or ""] += 1

    def record_response(self, op: str, status: int) -> None:
        self.responses[op][status] += 1

    def call_count(self, op: str, system_id: str | None = None) -> int:
        if system_id is None:
            return sum(self.calls[op].values())
        return self.calls[op][system_id]

    def calls_snapshot(self) -> dict[str, dict[str, int]]:
        return {op: dict(by_machine) for op, by_machine in self.calls.items()}

    def machine_debug(self, system_id: str) -> dict[str, Any]:
        """Everything about a machine, including the last deploy's user_data decoded for a fake host."""
        machine = self.machine(system_id)
        data = machine.to_json(API_ROOT)
        now = self.now()
        last = None
        if machine.last_deploy is not None:
            last = dict(machine.last_deploy)
            raw = last.pop("user_data")
            last["user_data"] = raw.decode("utf-8", errors="replace") if raw is not None else None
            last["user_data_b64"] = base64.b64encode(raw).decode() if raw is not None else None
            last["at_ago_seconds"] = now - last.pop("at")
        data["_sim"] = {
            "agent_name": machine.agent_name,
            "owner": machine.owner,
            "erase_mode": machine.erase_mode,
            "secure_erase_supported": machine.secure_erase_supported,
            "last_release": (
                {
                    **{k: v for k, v in machine.last_release.items() if k != "at"},
                    "ago_seconds": now - machine.last_release["at"],
                }
                if machine.last_release is not None
                else None
            ),
            "power_driver": "virsh" if machine.virsh is not None else None,
            "storage_layout": machine.storage_layout,
            "mac_address": machine.mac_address,
            "pending_failures": {s.label: m for s, m in machine.pending_failures.items()},
            "phase_seconds_left": (
                max(0.0, machine.phase_deadline - now) if machine.phase_deadline is not None else None
            ),
            "last_deploy": last,
            "history": [
                {"from": t.from_status.label, "to": t.to_status.label, "reason": t.reason, "ago_seconds": now - t.at}
                for t in machine.history
            ],
            "calls": {op: c[system_id] for op, c in self.calls.items() if c.get(system_id)},
            "deploys": [{"agent_name": d["agent_name"], "ago_seconds": now - d["at"]} for d in machine.deploys],
        }
        return data
