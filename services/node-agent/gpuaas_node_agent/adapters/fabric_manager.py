"""NVIDIA Fabric Manager in shared-NVSwitch mode, behind one interface: activate and deactivate the NVLink partition
of a VM's GPUs, list what is active, re-send the active list after Fabric Manager restarted, reset GPUs.

Two implementations with the same behaviour:
- `FmpmFabricManager` drives NVIDIA's partition tooling on a real host (`fmpm -l`, `-a ID`, `-d ID`, the sample
  tool the partitions reference names) and resets a GPU through its sysfs `reset` file (it sits on vfio-pci);
- `SimulatedFabricManager` keeps Fabric Manager's rules in a state file: the fixed HGX H200 table (its own, as
  Fabric Manager has its own), FM_ST_IN_USE for a partition that is active or shares a GPU with an active one,
  and after a restart a 60-second window in which only the active list is accepted, past which it exits.

The agent picks the real one where `fmpm` is installed, the simulator for a host tree (the simulated fleet, tests),
and on a real host without `fmpm` none: a task that needs a partition is refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from .host import Host

IN_USE = "FM_ST_IN_USE"
NOT_READY = "FM_ST_NOT_CONFIGURED"  # activation asked inside the restart window, before the active list came
NOT_RUNNING = "FM_ST_NOT_RUNNING"
BAD_PARTITION = "FM_ST_BADPARAM"
RESTART_WINDOW_S = 60.0
# fmReturn_t values of NVIDIA's nv_fm_types.h for the codes the agent tells apart.
_FM_CODES = {BAD_PARTITION: -1, IN_USE: -7, NOT_READY: -8}
_FM_RETURN = {n: c for c, n in _FM_CODES.items()}


class FabricManagerError(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class FabricManager(Protocol):
    async def activate(self, partition_id: int) -> None: ...
    async def deactivate(self, partition_id: int) -> None: ...
    async def active(self) -> list[int]: ...
    async def set_activated(self, partition_ids: Iterable[int]) -> None: ...
    async def generation(self) -> str | None:
        """Changes whenever Fabric Manager (re)started; None when it is not running."""
        ...

    async def reset_gpus(self, pci_addresses: Iterable[str]) -> None: ...


# --- the simulator -----------------------------------------------------------------------------------

_TABLE: dict[int, frozenset[int]] = {
    0: frozenset(range(1, 9)),
    1: frozenset({1, 2, 3, 4}),
    2: frozenset({5, 6, 7, 8}),
    3: frozenset({1, 3}),
    4: frozenset({2, 4}),
    5: frozenset({5, 7}),
    6: frozenset({6, 8}),
    **{6 + m: frozenset({m}) for m in range(1, 9)},
}


class SimulatedFabricManager:
    """State lives in a JSON file so an agent restart finds Fabric Manager as it left it, as on a host."""

    def __init__(self, state_file: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.state_file = state_file
        self.clock = clock
        # What happened, in order ("reset", addr) / ("activate", id) / ...: tests read the sequence from it.
        self.events: list[tuple[str, object]] = []

    def _load(self) -> dict[str, object]:
        try:
            return dict(json.loads(self.state_file.read_text()))
        except (FileNotFoundError, ValueError):
            return {"active": [], "generation": 1, "awaiting_until": None, "running": True}

    def _save(self, state: dict[str, object]) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)

    def _live(self) -> dict[str, object]:
        """The state, after the restart window's deadline has had its effect."""
        state = self._load()
        until = state.get("awaiting_until")
        if isinstance(until, float | int) and self.clock() > until:
            # Nobody sent the active list in time: Fabric Manager exits.
            state.update(running=False, awaiting_until=None)
            self._save(state)
        if not state.get("running"):
            raise FabricManagerError(NOT_RUNNING, "Fabric Manager is not running")
        return state

    def restart(self) -> None:
        """`nv-fabricmanager --restart`: running VMs keep their traffic, the agent has 60 s to re-send the list."""
        state = self._load()
        state.update(
            running=True,
            generation=int(state.get("generation") or 1) + 1,  # type: ignore[call-overload]
            awaiting_until=self.clock() + RESTART_WINDOW_S,
        )
        self._save(state)
        self.events.append(("restart", state["generation"]))

    def _ready(self) -> dict[str, object]:
        state = self._live()
        if state.get("awaiting_until") is not None:
            raise FabricManagerError(NOT_READY, "restarted: waiting for the list of active partitions")
        return state

    async def activate(self, partition_id: int) -> None:
        state = self._ready()
        if partition_id not in _TABLE:
            raise FabricManagerError(BAD_PARTITION, f"no partition {partition_id}")
        active = [int(a) for a in state["active"]]  # type: ignore[attr-defined]
        clash = [a for a in active if a == partition_id or _TABLE[a] & _TABLE[partition_id]]
        if clash:
            raise FabricManagerError(IN_USE, f"partition {partition_id} overlaps active partition(s) {clash}")
        state["active"] = sorted([*active, partition_id])
        self._save(state)
        self.events.append(("activate", partition_id))

    async def deactivate(self, partition_id: int) -> None:
        state = self._ready()
        active = [int(a) for a in state["active"]]  # type: ignore[attr-defined]
        if partition_id not in active:
            raise FabricManagerError(BAD_PARTITION, f"partition {partition_id} is not active")
        state["active"] = [a for a in active if a != partition_id]
        self._save(state)
        self.events.append(("deactivate", partition_id))

    async def active(self) -> list[int]:
        return sorted(int(a) for a in self._live()["active"])  # type: ignore[attr-defined]

    async def set_activated(self, partition_ids: Iterable[int]) -> None:
        state = self._live()
        ids = sorted(set(partition_ids))
        unknown = [p for p in ids if p not in _TABLE]
        if unknown:
            raise FabricManagerError(BAD_PARTITION, f"no partition {unknown}")
        state.update(active=ids, awaiting_until=None)
        self._save(state)
        self.events.append(("set_activated", tuple(ids)))

    async def generation(self) -> str | None:
        try:
            return str(self._live()["generation"])
        except FabricManagerError:
            return None

    async def reset_gpus(self, pci_addresses: Iterable[str]) -> None:
        for address in pci_addresses:
            self.events.append(("reset", address))


# --- the real one ------------------------------------------------------------------------------------


class FmpmFabricManager:
    def __init__(self, host: Host) -> None:
        self.host = host

    async def _fmpm(self, *args: str) -> str:
        res = await self.host.run.run("fmpm", *args)
        text = f"{res.stdout}\n{res.stderr}"
        if not res.ok:
            # fmpm exits with Fabric Manager's fmReturn_t (negative, so 256 + code) and prints "fmReturn: <code>".
            code = _FM_RETURN.get(res.rc - 256) or next(
                (c for c, n in _FM_CODES.items() if c in text or f"fmReturn: {n}" in text), "fmpm_failed"
            )
            raise FabricManagerError(code, f"fmpm {' '.join(args)} (rc {res.rc}): {text.strip()[:500]}")
        return res.stdout

    async def activate(self, partition_id: int) -> None:
        await self._fmpm("-a", str(partition_id))

    async def deactivate(self, partition_id: int) -> None:
        await self._fmpm("-d", str(partition_id))

    async def active(self) -> list[int]:
        """`fmpm -l` prints the supported partitions as JSON: `partitionInfo`, each with `partitionId` and
        `isActive` (0 or 1)."""
        out = await self._fmpm("-l")
        try:
            listing = json.loads(out[out.index("{") :])
        except ValueError as exc:
            raise FabricManagerError("fmpm_unreadable", f"fmpm -l printed no JSON: {out[:200]}") from exc
        parts = listing.get("partitionInfo") or listing.get("partitions") or []
        return sorted(int(p["partitionId"]) for p in parts if p.get("isActive"))

    async def set_activated(self, partition_ids: Iterable[int]) -> None:
        # fmSetActivatedFabricPartitions: comma-separated, no spaces; needs FABRIC_MODE_RESTART=1 on the host.
        await self._fmpm("--set-activated-list", ",".join(str(p) for p in sorted(set(partition_ids))))

    async def generation(self) -> str | None:
        res = await self.host.run.run(
            "systemctl", "show", "-p", "ActiveEnterTimestampMonotonic", "--value", "nvidia-fabricmanager"
        )
        value = res.stdout.strip()
        return value if res.ok and value not in ("", "0") else None

    async def reset_gpus(self, pci_addresses: Iterable[str]) -> None:
        for address in pci_addresses:
            path = self.host.fs.agent_path(f"/sys/bus/pci/devices/{address}/reset")
            try:
                path.write_text("1\n")
            except OSError as exc:
                raise FabricManagerError("gpu_reset_failed", f"{address}: {exc}") from exc


class NoFabricManager:
    """A host at / without `fmpm`: nothing can activate a partition, so a task that needs one is refused."""

    async def activate(self, partition_id: int) -> None:
        raise FabricManagerError(NOT_RUNNING, "fmpm is not installed on this host")

    async def deactivate(self, partition_id: int) -> None:
        raise FabricManagerError(NOT_RUNNING, "fmpm is not installed on this host")

    async def active(self) -> list[int]:
        return []

    async def set_activated(self, partition_ids: Iterable[int]) -> None:
        return None

    async def generation(self) -> str | None:
        return None

    async def reset_gpus(self, pci_addresses: Iterable[str]) -> None:
        return None


def fabric_manager_for(host: Host, state_dir: Path) -> FabricManager:
    """The real adapter where `fmpm` is installed; the simulator only for an agent working on a host tree other
    than / (the simulated fleet and tests), never silently on a real host."""
    if host.run.which("fmpm") is not None:
        return FmpmFabricManager(host)
    if Path(host.run.root).resolve() != Path("/"):
        return SimulatedFabricManager(state_dir / "fabric-manager.json")
    return NoFabricManager()
