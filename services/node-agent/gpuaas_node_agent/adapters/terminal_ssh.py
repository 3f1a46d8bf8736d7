"""The slice terminal's SSH session: OpenSSH's client with a remote PTY (`-tt`) into the guest, logged in with
the node-local relay key and held to the host key the guest's seed planted, bytes in and out over pipes.

OpenSSH does the protocol and the PTY request; this module only starts it, feeds it and reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path


class TerminalSshError(RuntimeError):
    pass


def terminal_argv(
    ip: str, port: int, user: str, key: Path, known_hosts: Path, host_key_kind: str, *, cols: int, rows: int
) -> list[str]:
    """`ssh -tt`: a PTY on the guest although our end is a pipe. The size goes to the remote shell through
    stty, since OpenSSH takes a PTY's size from its own terminal, which a pipe has not."""
    return [
        "ssh",
        "-tt",
        "-F", "/dev/null",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", f"HostKeyAlgorithms={host_key_kind}",
        "-o", "IdentitiesOnly=yes",
        "-o", "ConnectTimeout=10",
        "-o", "ServerAliveInterval=15",
        "-o", "LogLevel=ERROR",
        "-i", str(key),
        "-p", str(port),
        f"{user}@{ip}",
        f"stty cols {cols} rows {rows} 2>/dev/null; exec \"$SHELL\" -l",
    ]  # fmt: skip


class SshPty:
    """One running `ssh -tt`; `read` gives what the guest wrote (b"" at its end), `write` types into it."""

    def __init__(self, proc: asyncio.subprocess.Process, tmp: tempfile.TemporaryDirectory[str]) -> None:
        self._proc = proc
        self._tmp = tmp

    @classmethod
    async def open(
        cls, ip: str, port: int, user: str, key: Path, host_public_line: str, *, cols: int = 80, rows: int = 24
    ) -> SshPty:
        parts = host_public_line.split()
        if len(parts) < 2:
            raise TerminalSshError("the guest's planted host key is not an OpenSSH public key")
        kind, blob = parts[:2]
        tmp = tempfile.TemporaryDirectory(prefix="gpuaas-terminal-")
        known_hosts = Path(tmp.name) / "known_hosts"
        known_hosts.write_text(f"{ip if port == 22 else f'[{ip}]:{port}'} {kind} {blob}\n")
        argv = terminal_argv(ip, port, user, key, known_hosts, kind, cols=cols, rows=rows)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,  # ssh's own words (a refused login) are the tenant's to see
                env={**os.environ, "LC_ALL": "C"},
            )
        except FileNotFoundError as exc:
            tmp.cleanup()
            raise TerminalSshError("ssh is not installed on this host") from exc
        return cls(proc, tmp)

    async def read(self, limit: int) -> bytes:
        assert self._proc.stdout is not None
        return await self._proc.stdout.read(limit)

    async def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(data)
        with contextlib.suppress(ConnectionError):  # ssh gone: its output's end says so
            await self._proc.stdin.drain()

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def close(self) -> int:
        """End the session (if ssh still runs) and give its exit status."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()
        try:
            rc = await self._proc.wait()
        finally:
            self._tmp.cleanup()
        return rc
