"""GPU module IDs and Fabric Manager facts from the host's own tools (issue 29, point 1): `nvidia-smi -q` as a
real H200 prints it (tests/fixtures/gpu_hosts), the spellings older drivers use, and the map's consistency."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuaas_node_agent.domain.gpu_modules import fabric_mode, fabric_version, mapping_problems, parse_module_ids

REAL = Path(__file__).resolve().parents[1] / "fixtures/gpu_hosts/h200-passthrough-guest"


def test_the_real_h200_output_maps_its_gpu_to_its_module() -> None:
    modules, problems = parse_module_ids((REAL / "nvidia-smi-q.txt").read_text())
    assert (modules, problems) == ({"0000:00:06.0": 2}, [])


def _block(addr: str, line: str) -> str:
    return f"GPU {addr}\n    Product Name : NVIDIA H200\n    Platform Info\n{line}\n    Module Power Readings\n"


@pytest.mark.parametrize(
    "line, modules, problems",
    [
        ("        Module Id                                      : 5", {"0000:0f:00.0": 5}, []),
        ("        Module ID : 7", {"0000:0f:00.0": 7}, []),
        ("    GPU Module ID : 3", {"0000:0f:00.0": 3}, []),
        ("        Module Id : N/A", {}, ["GPU 0000:0f:00.0 reports module ID N/A, not one of 1-8"]),
        ("        Module Id : 9", {}, ["GPU 0000:0f:00.0 reports module ID 9, not one of 1-8"]),
        # Power readings of the module are no module ID.
        ("        Average Power Draw : N/A", {}, []),
    ],
)
def test_module_id_lines(line: str, modules: dict, problems: list) -> None:
    assert parse_module_ids(_block("00000000:0F:00.0", line)) == (modules, problems)


def test_every_gpu_block_gets_its_own_module() -> None:
    text = _block("00000000:86:00.0", "  Module Id : 1") + _block("00000000:87:00.0", "  Module Id : 3")
    assert parse_module_ids(text)[0] == {"0000:86:00.0": 1, "0000:87:00.0": 3}


@pytest.mark.parametrize(
    "gpus, modules, problems",
    [
        (["a", "b"], {"a": 1, "b": 3}, []),
        # None mapped: an older board or no driver tools, placed without partitions.
        (["a", "b"], {}, []),
        (["a", "b"], {"a": 1}, ["GPU b has no module ID while other GPUs of the host do"]),
        (["a", "b", "c"], {"a": 1, "b": 1, "c": 2}, ["module ID 1 is claimed by 2 GPUs: a, b"]),
    ],
)
def test_mapping_problems(gpus: list, modules: dict, problems: list) -> None:
    assert mapping_problems(gpus, modules) == problems


@pytest.mark.parametrize(
    "cfg, mode",
    [
        ("FABRIC_MODE=1\n", "shared_nvswitch"),
        ("# FABRIC_MODE=1\nLOG_LEVEL=4\n", "baremetal"),
        ("FABRIC_MODE=0\n", "baremetal"),
        ("FABRIC_MODE=2\n", "vgpu"),
        ("FABRIC_MODE=7\n", "unknown"),
        (None, "unknown"),
    ],
)
def test_fabric_mode(cfg: str | None, mode: str) -> None:
    assert fabric_mode(cfg) == mode


def test_fabric_version() -> None:
    assert fabric_version("Fabric Manager version is : 550.127.05\n") == "550.127.05"
    assert fabric_version("nv-fabricmanager: unknown option") is None
