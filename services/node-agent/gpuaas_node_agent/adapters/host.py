"""Everything the agent reads from or runs on its host, seen through one root directory.

The root is "/" in production and a generated fixture tree in tests and on simulated hosts, so the code
that decides whether a disk may be wiped reads exactly the same files in both.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

# Where a rooted runner looks for executables, inside the root.
SEARCH_PATH = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")
_MAX_LINKS = 40


class HostFs:
    """Reads host files by their host path ("/sys/…"), resolving symlinks without leaving the root."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def agent_path(self, host_path: str | os.PathLike[str]) -> Path:
        return self.root / str(host_path).lstrip("/")

    def exists(self, host_path: str) -> bool:
        return os.path.lexists(self.agent_path(host_path))

    def read(self, host_path: str) -> str | None:
        try:
            return self.agent_path(host_path).read_text(errors="replace").strip()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
            return None

    def read_raw(self, host_path: str) -> str | None:
        try:
            return self.agent_path(host_path).read_text(errors="replace")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
            return None

    def listdir(self, host_path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.agent_path(host_path)))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return []

    def realpath(self, host_path: str) -> str:
        """The host path with every symlink followed. Absolute link targets are taken relative to the root
        (a fixture tree must not reach into the machine that runs the tests); `..` never climbs above it."""
        parts = [p for p in host_path.split("/") if p]
        resolved: list[str] = []
        links = 0
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            candidate = "/" + "/".join([*resolved, part])
            agent = self.agent_path(candidate)
            if agent.is_symlink():
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(f"too many levels of symbolic links under {host_path}")
                target = os.readlink(agent)
                if target.startswith("/"):
                    resolved = []
                parts = [p for p in target.split("/") if p] + parts
                continue
            resolved.append(part)
        return "/" + "/".join(resolved)

    def link_name(self, host_path: str) -> str | None:
        """Last component of a symlink's target (`driver` → `vfio-pci`), None when it is not a link."""
        agent = self.agent_path(host_path)
        if not agent.is_symlink():
            return None
        return os.readlink(agent).rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


class CommandRunner:
    """Runs host tools found under the root (never through a shell). On a fixture root the tools are the
    fixture's own small scripts, so a test exercises the same execution and parsing path as a host."""

    def __init__(self, root: str | os.PathLike[str], *, timeout_s: float = 30.0) -> None:
        self.root = Path(root)
        self.timeout_s = timeout_s

    def which(self, name: str) -> Path | None:
        for directory in SEARCH_PATH:
            candidate = self.root / directory / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        return None

    async def run(self, *argv: str, timeout_s: float | None = None) -> CommandResult:
        exe = self.which(argv[0])
        if exe is None:
            return CommandResult(tuple(argv), 127, "", f"{argv[0]}: command not found under {self.root}")
        proc = await asyncio.create_subprocess_exec(
            str(exe),
            *argv[1:],
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "LC_ALL": "C", "GPUAAS_HOST_ROOT": str(self.root)},
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s or self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            proc.kill()
            await proc.wait()
            raise
        assert proc.returncode is not None
        return CommandResult(
            tuple(argv), proc.returncode, out.decode(errors="replace"), err.decode(errors="replace").strip()
        )


@dataclass(frozen=True)
class Host:
    fs: HostFs
    run: CommandRunner

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> Host:
        return cls(HostFs(root), CommandRunner(root))
