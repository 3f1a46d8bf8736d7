"""A host a deploy made a baremetal tenant's never runs the slice role nor announces itself as a slice host:
not by default (the role follows the deploy's env file), not when told to (refused at start), and not through
run_slice_host called directly (the simulated fleet's way), which refuses before it opens the bus."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuaas_common.enrolment import enrolment_token
from gpuaas_common.startup import StartupFailed
from gpuaas_node_agent.domain.baremetal import NODE_ENV_PATH, RoleRefused
from gpuaas_node_agent.entrypoints.host import refuse_a_deployed_host, run_slice_host
from gpuaas_node_agent.entrypoints.main import build_register
from gpuaas_node_agent.settings import AgentSettings

ALLOC = "0b5f7c1e-2a43-4d8e-9f60-7a1b2c3d4e5f"


def deployed(root: Path) -> Path:
    """The host's root after its baremetal deploy's first boot: cloud-init wrote the agent's env file."""
    env = root / NODE_ENV_PATH.lstrip("/")
    env.parent.mkdir(parents=True)
    env.write_text(
        f"GPUAAS_NODE_ID=bm-07\nGPUAAS_ALLOCATION_ID={ALLOC}\nGPUAAS_MAAS_SYSTEM_ID=sys-7\n"
        f"GPUAAS_ENROLMENT_TOKEN={enrolment_token('secret', ALLOC, 'sys-7')}\n"
    )
    return root


class NoLink:
    """A host link the refused agent must never open."""

    opened = False

    async def open(self) -> None:
        self.opened = True
        raise AssertionError("a deployed host opened its bus as a slice host")


def test_by_default_a_deployed_host_runs_the_baremetal_role(tmp_path: Path) -> None:
    root = deployed(tmp_path / "host")
    register = build_register(AgentSettings(host_root=str(root), node_id="bm-07"))
    assert "build_baremetal_register" in register.__qualname__
    # An undeployed host is a slice host.
    register = build_register(AgentSettings(host_root=str(tmp_path / "slice"), node_id="n1"))
    assert "build_baremetal_register" not in register.__qualname__


def test_told_to_be_a_slice_host_a_deployed_host_refuses_to_start(tmp_path: Path) -> None:
    root = deployed(tmp_path / "host")
    with pytest.raises(StartupFailed, match="cannot enrol as a slice host"):
        build_register(AgentSettings(host_root=str(root), node_id="bm-07", role="slice_host"))


async def test_run_slice_host_refuses_a_deployed_host_before_it_touches_the_bus(tmp_path: Path) -> None:
    root = deployed(tmp_path / "host")
    link = NoLink()
    with pytest.raises(RoleRefused, match="cannot enrol as a slice host"):
        await run_slice_host(AgentSettings(host_root=str(root), node_id="bm-07"), "bm-07", "bm-07", root, 22, link)  # type: ignore[arg-type]
    assert not link.opened
    refuse_a_deployed_host(tmp_path / "slice")  # an undeployed root passes
