"""The lab refuses to start on a machine that lacks a piece, in one line that names it and its package."""

from __future__ import annotations

import pytest

from gpuaas_dev.lab import preflight


def test_a_missing_piece_is_named_with_its_package_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = preflight.Requirement("qemu-system-gpuaas-nonexistent", "qemu-system-x86")
    monkeypatch.setattr(preflight, "REQUIREMENTS", (*preflight.REQUIREMENTS, missing))
    with pytest.raises(preflight.LabUnavailable) as refused:
        preflight.check()
    text = str(refused.value)
    assert "\n" not in text
    assert "qemu-system-gpuaas-nonexistent (Debian package qemu-system-x86)" in text
    assert "scripts/setup.sh" in text
    assert not preflight.installed()


def test_a_missing_file_counts_as_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = preflight.Requirement("/nonexistent/OVMF_CODE_4M.fd", "ovmf")
    monkeypatch.setattr(preflight, "REQUIREMENTS", (gone,))
    assert preflight.missing_requirements() == [gone]
