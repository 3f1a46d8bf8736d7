"""The anonymous `describe/` document, generated from the simulator's own handler table.

python-libmaas builds every call from this document: for each resource it takes the `auth`
handler (or `anon` when it has no credentials), derives a name by stripping `Anon`/`Handler`,
formats the absolute `uri` with `params`, and sends `op` for non-restful actions. So the table
that routes requests is the same one that is described, and the two cannot drift.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ActionSpec:
    name: str
    method: str
    op: str | None
    doc: str = ""

    @property
    def restful(self) -> bool:
        return self.op is None


@dataclass(frozen=True)
class HandlerSpec:
    name: str  # MAAS's class name, e.g. "MachineHandler"
    path: str  # relative to the API root, with `{param}` placeholders, e.g. "machines/{system_id}/"
    params: tuple[str, ...]
    actions: tuple[ActionSpec, ...]
    anon: bool = False
    doc: str = ""


def describe_handler(spec: HandlerSpec, api_root: str, base_url: str) -> dict[str, Any]:
    path = api_root + spec.path
    return {
        "name": spec.name,
        "doc": spec.doc,
        "path": path,
        "uri": base_url.rstrip("/") + path,
        "params": list(spec.params),
        "actions": [
            {"name": a.name, "method": a.method, "op": a.op, "restful": a.restful, "doc": a.doc} for a in spec.actions
        ],
    }


def describe_document(handlers: Sequence[HandlerSpec], api_root: str, base_url: str, api_hash: str) -> dict[str, Any]:
    described = [describe_handler(h, api_root, base_url) for h in handlers]
    resources = []
    for spec, desc in zip(handlers, described, strict=True):
        resources.append(
            {
                "name": spec.name,
                "anon": desc if spec.anon else None,
                "auth": None if spec.anon else desc,
            }
        )
    return {"doc": "MAAS API", "hash": api_hash, "resources": resources, "handlers": described}


def compute_api_hash(handlers: Sequence[HandlerSpec], api_root: str) -> str:
    """Stable across hosts and ports: MAAS hashes the API shape, not where it is served."""
    shape = [describe_handler(h, api_root, "") for h in handlers]
    return hashlib.sha1(json.dumps(shape, sort_keys=True).encode("utf-8")).hexdigest()
