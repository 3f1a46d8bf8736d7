"""The import-linter contracts of pyproject.toml hold: services never import each other or the dev tools."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lint_imports_passes():
    binary = Path(sys.executable).parent / "lint-imports"
    assert binary.exists(), "lint-imports is missing from the venv; run `make setup`"
    proc = subprocess.run([str(binary), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"lint-imports failed:\n{proc.stdout}\n{proc.stderr}"
    assert "0 broken" in proc.stdout, proc.stdout
