"""Host paths seen through the agent's root ("/" in production, a fixture tree in tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostPaths:
    root: Path

    def host(self, path: str | Path) -> Path:
        """The agent-side path of an absolute host path."""
        return self.root / str(path).lstrip("/")
