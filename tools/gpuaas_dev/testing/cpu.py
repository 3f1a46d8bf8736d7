"""CPU a process has used, from /proc, for benchmarks that measure one process at a time."""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process `pid` so far (its own threads, not its children)."""
    # The command name in field 2 may hold spaces and parentheses: the fields after it follow the last ")".
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
