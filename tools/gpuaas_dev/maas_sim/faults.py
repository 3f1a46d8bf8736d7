"""Fault injection: which call misbehaves, how, and how often.

A fault matches an operation name (as counted in `/_sim/calls`, e.g. `deploy`, or `*`) and a
machine (or every machine). It fires for its next `count` matching calls and/or with
`probability` drawn from the simulator's seeded RNG, so a flaky run can be replayed.

Faults that model MAAS answering after it committed (`lost_after_commit`, and by default
`unavailable`, `gateway_timeout`, `server_error` and `latency`) run the operation first; `conflict`
(a rolled-back serialization failure) never commits. Set `commit` to override. `altered_user_data` (on `deploy`)
hands the machine user-data other than what the deploy sent: its enrolment token changed, as a tampering hop or a
broken metadata service would. `failed_deployment` (on `deploy`) and `failed_disk_erasing` (on `release`) make the
phase the call starts end in its failed state, with `status_message`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FaultKind = Literal[
    "latency",
    "lost_after_commit",
    "conflict",
    "unavailable",
    "gateway_timeout",
    "server_error",
    "failed_deployment",
    "failed_disk_erasing",
    "altered_user_data",
]
FAULT_KINDS: tuple[str, ...] = FaultKind.__args__  # type: ignore[attr-defined]

_COMMITS_BY_DEFAULT = {
    "latency": True,
    "lost_after_commit": True,
    "conflict": False,
    "unavailable": True,
    "gateway_timeout": True,
    "server_error": True,
    "failed_deployment": True,
    "failed_disk_erasing": True,
    "altered_user_data": True,
}

_MESSAGES_BY_DEFAULT = {
    "failed_deployment": "Failed deployment: curtin installation failed",
    "failed_disk_erasing": "Failed to erase disks: wipe-disks exited 1",
}

_ids = itertools.count(1)


@dataclass
class Fault:
    kind: str
    op: str = "*"
    system_id: str | None = None
    count: int | None = None
    probability: float | None = None
    latency: float = 0.0
    commit: bool | None = None
    # lost_after_commit: "hold" keeps the socket open past any client timeout; "close" drops it.
    mode: str = "hold"
    hold_seconds: float = 600.0
    # None: the kind's own (failed_deployment's curtin failure, failed_disk_erasing's wipe failure).
    status_message: str | None = None
    # Retry-After of a conflict (MAAS: 5) or unavailable (MAAS: 10) answer; tests shorten it.
    retry_after: float | None = None
    fired: int = 0
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {', '.join(FAULT_KINDS)}")
        if self.mode not in ("hold", "close"):
            raise ValueError("mode is 'hold' or 'close'")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise ValueError("probability is between 0 and 1")
        if self.commit is None:
            self.commit = _COMMITS_BY_DEFAULT[self.kind]
        if self.status_message is None:
            self.status_message = _MESSAGES_BY_DEFAULT.get(self.kind, "")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fault:
        allowed = {
            "kind",
            "op",
            "system_id",
            "count",
            "probability",
            "latency",
            "commit",
            "mode",
            "hold_seconds",
            "status_message",
            "retry_after",
        }
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        return cls(**data)

    def matches(self, op: str, system_id: str | None) -> bool:
        if self.op not in ("*", op):
            return False
        return self.system_id is None or self.system_id == system_id

    @property
    def exhausted(self) -> bool:
        return self.count is not None and self.fired >= self.count

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FaultBook:
    def __init__(self, seed: int = 0) -> None:
        self._faults: list[Fault] = []
        self._rng = random.Random(seed)

    def add(self, fault: Fault) -> Fault:
        self._faults.append(fault)
        return fault

    def clear(self, fault_id: int | None = None) -> None:
        if fault_id is None:
            self._faults.clear()
        else:
            self._faults = [f for f in self._faults if f.id != fault_id]

    def list(self) -> list[Fault]:
        return list(self._faults)

    def draw(self, op: str, system_id: str | None) -> list[Fault]:
        """Faults that fire for this call, in the order they were added; consumes counts."""
        fired: list[Fault] = []
        for fault in self._faults:
            if fault.exhausted or not fault.matches(op, system_id):
                continue
            if fault.probability is not None and self._rng.random() >= fault.probability:
                continue
            fault.fired += 1
            fired.append(fault)
        self._faults = [f for f in self._faults if not f.exhausted]
        return fired
