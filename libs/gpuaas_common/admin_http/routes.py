"""What a service declares (`Route`), what its handler sees (`Call`) and may answer (`Reply`)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiohttp import web
from pydantic import BaseModel

from ..unit_of_work import UnitOfWork
from .headers import MUTATIONS


@dataclass
class Reply:
    """A handler's answer when its status is not the route's first one (e.g. 202 for queued work)."""

    body: Any
    status: int


@dataclass
class Call:
    """What a handler sees: its validated inputs, who asked, and where to do its work."""

    request: web.Request
    params: dict[str, str]
    query: dict[str, str | None]
    body: Any
    principal: str
    actor: str
    request_id: str
    conn: asyncpg.Connection
    uow: UnitOfWork | None = None
    after_commit: list[Callable[[], None]] = field(default_factory=list)


Handler = Callable[[Call], Awaitable[Any]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    response: type[BaseModel]
    body: type[BaseModel] | None = None
    statuses: tuple[int, ...] = (200,)
    errors: tuple[int, ...] = ()
    query: tuple[str, ...] = ()
    body_required: bool = True
    # The right a principal needs for it (principals.py); by default `write` for a mutation, `read` otherwise.
    right: str | None = None

    @property
    def mutation(self) -> bool:
        return self.method in MUTATIONS

    @property
    def needs(self) -> str:
        return self.right or ("write" if self.mutation else "read")

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"\{(\w+)\}", self.path)

    def documented_errors(self) -> list[int]:
        out = {401, 403, *self.errors}
        if self.path_params or self.query or self.body is not None:
            out.add(422)
        if self.path_params:
            out.add(404)
        if self.mutation:
            out |= {400, 409}
        return sorted(out)
