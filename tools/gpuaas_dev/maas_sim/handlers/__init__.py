"""MAAS API operations of the simulator and the handler table that routes and describes them.

Operations are synchronous: each one is a single "transaction" against `SimState`. Faults,
latency and call counting wrap them in `app.py`, which is what lets a fault answer *after* the
state change was committed, the way MAAS does when a post-commit power RPC fails.

One module per MAAS resource (machines, tags, boot_resources, scripts), the building blocks in routing and
the table itself in routes.
"""

from __future__ import annotations

from .routes import ROUTES
from .routing import Call, Created, NoContent, Operation, OpFn, Route

__all__ = ["ROUTES", "Call", "Created", "NoContent", "OpFn", "Operation", "Route"]
