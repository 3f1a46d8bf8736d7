"""The handler table's building blocks: one call's context, an operation, a route, and the 201/204 answers."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..describe import ActionSpec, HandlerSpec
from ..machines import Machine
from ..state import SimState
from ..wire import Params


@dataclass(frozen=True)
class Call:
    state: SimState
    params: Params
    path: dict[str, str]

    @property
    def machine(self) -> Machine:
        return self.state.machine(self.path["system_id"])


OpFn = Callable[[Call], Any]


@dataclass(frozen=True)
class Operation:
    name: str  # the name calls are counted and faults are matched under
    method: str
    op: str | None
    fn: OpFn
    mutation: bool
    doc: str = ""

    @property
    def action_name(self) -> str:
        if self.op is not None:
            return self.op
        return {"GET": "read", "POST": "create", "PUT": "update", "DELETE": "delete"}[self.method]


@dataclass(frozen=True)
class Route:
    handler: str
    path: str
    operations: tuple[Operation, ...]
    anon: bool = False
    doc: str = ""

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)\}", self.path))

    @property
    def pattern(self) -> re.Pattern[str]:
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.path)
        return re.compile(f"^{regex}$")

    def find(self, method: str, op: str | None) -> Operation | None:
        for operation in self.operations:
            if operation.method == method and operation.op == op:
                return operation
        return None

    def spec(self) -> HandlerSpec:
        return HandlerSpec(
            name=self.handler,
            path=self.path,
            params=self.params,
            anon=self.anon,
            doc=self.doc,
            actions=tuple(ActionSpec(o.action_name, o.method, o.op, o.doc) for o in self.operations),
        )


@dataclass(frozen=True)
class Created:
    """A 201 answer (MAAS creates boot resources with 201, most other things with 200)."""

    data: Any


@dataclass(frozen=True)
class NoContent:
    """A 204 answer."""
