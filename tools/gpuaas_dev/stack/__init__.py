"""The embedded development stack: real NATS and Postgres, the MAAS simulator and the five services as
separate processes, with a simulated fleet behind them.

Synchronous on purpose: tests, the benchmark and the CLI drive it with plain calls, from inside an event
loop or not. The one async step (creating the database) runs on a private thread.

    stack = Stack(Path(".run/dev"))
    stack.start()            # returns once every service answers /readyz
    stack.kill("allocator")  # SIGKILL by PID
    stack.restart("allocator")
    stack.stop()

Modules: `stack` (the Stack class and its lifecycle), `processes` (spawn, signals, readiness),
`environment` (each process's argv and env), `identities` (NATS trust chain, creds, provisioning),
`database` (the database and per-service roles), `description` (stack.json and secrets.json),
`fleet` (the simulated fleet's files).
"""

from .database import DATABASE
from .fleet import FLEET_SUBNET, maas_machines, prepare_fleet_dir
from .processes import ALL_PROCESSES, MAAS_SIM, SERVICES, StackError, bin_path, tail
from .stack import Stack

__all__ = [
    "ALL_PROCESSES",
    "DATABASE",
    "FLEET_SUBNET",
    "MAAS_SIM",
    "SERVICES",
    "Stack",
    "StackError",
    "bin_path",
    "maas_machines",
    "prepare_fleet_dir",
    "tail",
]
