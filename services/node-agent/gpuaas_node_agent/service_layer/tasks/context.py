"""What the task objects are given: the host's adapters and the agent's directories on it (HostContext), the
locks that keep two tasks, or a task and the reconciler, off one slot or VM (TaskLocks), and the refusal and
failure every task may end in."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuaas_common.logging import get_logger

from ...adapters.guest_ssh import LoginOutcome
from ...adapters.host import Host
from ...adapters.libvirt_host import LibvirtHost
from ...adapters.state_store import StateStore
from ..host_paths import HostPaths

log = get_logger("gpuaas_node_agent.service_layer.tasks")  # one logger name for the whole task runner

Publish = Callable[..., Awaitable[Any]]
GuestLogin = Callable[[str], Awaitable[LoginOutcome]]


class Refused(Exception):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class TaskFailed(Exception):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class HostContext:
    """The host one agent works on. The directories are agent-side paths (HostPaths applied once, here)."""

    node_id: str
    paths: HostPaths
    store: StateStore
    libvirt: LibvirtHost
    publish: Publish
    host: Host
    hostsdir: Path
    lease_file: Path
    seed_dir: Path

    @classmethod
    def on(
        cls,
        node_id: str,
        paths: HostPaths,
        store: StateStore,
        libvirt: LibvirtHost,
        publish: Publish,
        *,
        hostsdir: str,
        lease_file: str,
        seed_dir: str,
    ) -> HostContext:
        """The context of the host under `paths.root`, its directories given as host paths."""
        return cls(
            node_id=node_id,
            paths=paths,
            store=store,
            libvirt=libvirt,
            publish=publish,
            host=Host.at(paths.root),
            hostsdir=paths.host(hostsdir),
            lease_file=paths.host(lease_file),
            seed_dir=paths.host(seed_dir),
        )


class TaskLocks:
    """Tasks on disjoint slots run in parallel, as on a real host; two tasks that share a slot never interleave.
    A VM's lock is held by the task working on it, so the periodic reconciler never acts on a VM mid-task."""

    def __init__(self) -> None:
        self._slots: dict[str, asyncio.Lock] = {}
        self._vms: dict[str, asyncio.Lock] = {}

    def slot(self, slot_id: str) -> asyncio.Lock:
        return self._slots.setdefault(slot_id, asyncio.Lock())

    def vm(self, vm_name: str) -> asyncio.Lock:
        return self._vms.setdefault(vm_name, asyncio.Lock())

    def slot_busy(self, slot_id: str) -> bool:
        lock = self._slots.get(slot_id)
        return lock is not None and lock.locked()

    def vm_busy(self, vm_name: str) -> bool:
        lock = self._vms.get(vm_name)
        return lock is not None and lock.locked()
