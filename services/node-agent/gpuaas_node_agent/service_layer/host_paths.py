"""Host paths seen through the agent's root ("/" in production, a fixture tree in tests).

A host may keep an agent-owned directory elsewhere than its runbook path (the lab keeps everything it writes
under a prefix of its own, so that removing the lab removes it): `mapped` sends a host directory, and all below
it, to another agent-side directory. The runbook paths stay what tasks and the catalog speak.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class HostPaths:
    root: Path
    mapped: tuple[tuple[str, Path], ...] = ()

    def host(self, path: str | Path) -> Path:
        """The agent-side path of an absolute host path."""
        wanted = PurePosixPath("/") / str(path).lstrip("/")
        # Longest host directory first, so a map of /var/lib/gpuaas/x wins over one of /var/lib/gpuaas.
        for host_dir, agent_dir in sorted(self.mapped, key=lambda m: -len(m[0])):
            if wanted == PurePosixPath(host_dir) or PurePosixPath(host_dir) in wanted.parents:
                return agent_dir / wanted.relative_to(host_dir)
        return self.root / str(path).lstrip("/")
