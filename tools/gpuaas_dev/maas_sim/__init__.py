"""A MAAS 2.0 API simulator that python-libmaas and the gateway's client can talk to.

Public surface: `SimConfig`, `MachineSpec`, `create_app`, `start`, `run`, `system_id_for`.
"""

from .app import create_app
from .auth import ApiKey, generate_api_key
from .config import MachineSpec, SimConfig
from .faults import Fault
from .machines import Machine, NodeStatus, Timers, system_id_for
from .server import run, start, state_of

__all__ = [
    "ApiKey",
    "Fault",
    "Machine",
    "MachineSpec",
    "NodeStatus",
    "SimConfig",
    "Timers",
    "create_app",
    "generate_api_key",
    "run",
    "start",
    "state_of",
    "system_id_for",
]
