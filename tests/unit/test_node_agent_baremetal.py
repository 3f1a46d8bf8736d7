"""The baremetal role's rules and its announcement loop, without a bus (the bus is in
tests/integration/test_node_agent_baremetal.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from gpuaas_common.contract import Envelope
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.enrolment import enrolment_token, token_proof
from gpuaas_node_agent.adapters.node_env import host_uptime, read_node_env
from gpuaas_node_agent.domain.baremetal import (
    NodeEnvInvalid,
    RoleRefused,
    announcement_id,
    choose_role,
    enrolment,
    parse_node_env,
    pause_before_repeat,
)
from gpuaas_node_agent.service_layer.baremetal import BaremetalHostAgent

ALLOC = "0b5f7c1e-2a43-4d8e-9f60-7a1b2c3d4e5f"
TOKEN = enrolment_token("secret", ALLOC, "sys-7")
GOOD = (
    f"GPUAAS_NODE_ID=bm-07\nGPUAAS_ALLOCATION_ID={ALLOC}\nGPUAAS_MAAS_SYSTEM_ID=sys-7\n"
    f"GPUAAS_ENROLMENT_TOKEN={TOKEN}\nGPUAAS_NATS_CREDS=/etc/gpuaas/node.creds\n"
)


@pytest.mark.parametrize(
    ("setting", "present", "role"),
    [
        ("auto", True, "baremetal"),
        ("auto", False, "slice_host"),
        ("baremetal", True, "baremetal"),
        ("slice_host", False, "slice_host"),
    ],
)
def test_the_role_follows_the_deploys_file(setting, present, role) -> None:
    assert choose_role(setting, present) == role


def test_a_deployed_host_is_never_a_slice_host_and_a_baremetal_agent_needs_its_file() -> None:
    with pytest.raises(RoleRefused, match="cannot enrol as a slice host"):
        choose_role("slice_host", True)
    with pytest.raises(RoleRefused, match="no /etc/gpuaas/node-agent.env"):
        choose_role("baremetal", False)


def test_the_gateways_file_parses_to_the_hosts_identity() -> None:
    identity = parse_node_env("# written by cloud-init\n\n" + GOOD)
    assert (identity.node_id, identity.allocation_id, identity.maas_system_id) == ("bm-07", uuid.UUID(ALLOC), "sys-7")
    assert (identity.token, identity.creds_path) == (TOKEN, "/etc/gpuaas/node.creds")
    assert TOKEN not in repr(identity)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "has no GPUAAS_NODE_ID, GPUAAS_ALLOCATION_ID, GPUAAS_MAAS_SYSTEM_ID, GPUAAS_ENROLMENT_TOKEN"),
        (GOOD.replace(f"GPUAAS_ENROLMENT_TOKEN={TOKEN}\n", ""), "has no GPUAAS_ENROLMENT_TOKEN"),
        (GOOD.replace(f"GPUAAS_ENROLMENT_TOKEN={TOKEN}", "GPUAAS_ENROLMENT_TOKEN="), "has no GPUAAS_ENROLMENT_TOKEN"),
        (GOOD.replace(TOKEN, TOKEN[:40]), "GPUAAS_ENROLMENT_TOKEN is not the 64 hex digits"),
        (GOOD + f"garbage {TOKEN}\n", "line 6 is not a GPUAAS_NAME=value line"),
        ("\x00\x01" + GOOD, "line 1 is not"),
        (GOOD.replace(ALLOC, "a-1"), "GPUAAS_ALLOCATION_ID is not a UUID"),
        (GOOD.replace("bm-07", "bm 07/x"), "GPUAAS_NODE_ID is not a node id"),
        (GOOD.replace("=/etc/gpuaas/node.creds", "=node.creds"), "GPUAAS_NATS_CREDS is not an absolute path"),
    ],
)
def test_a_garbled_file_is_refused_naming_what_without_the_secret(text: str, says: str) -> None:
    with pytest.raises(NodeEnvInvalid, match=says) as refused:
        parse_node_env(text)
    assert TOKEN[:40] not in str(refused.value)


def test_the_file_is_read_under_the_host_root_with_the_creds_it_names(tmp_path: Path) -> None:
    with pytest.raises(NodeEnvInvalid, match="is not there"):
        read_node_env(tmp_path)
    (tmp_path / "etc/gpuaas").mkdir(parents=True)
    (tmp_path / "etc/gpuaas/node-agent.env").write_text(GOOD)
    with pytest.raises(NodeEnvInvalid, match="GPUAAS_NATS_CREDS=/etc/gpuaas/node.creds, which is not there"):
        read_node_env(tmp_path)
    (tmp_path / "etc/gpuaas/node.creds").write_text("creds")
    assert read_node_env(tmp_path).node_id == "bm-07"


def test_the_first_boot_is_the_hosts_own_uptime_and_a_tree_without_proc_reports_none(tmp_path: Path) -> None:
    assert host_uptime(tmp_path) is None  # a simulated host's tree: no made-up boot time
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/uptime").write_text("83.27 160.11\n")
    assert host_uptime(tmp_path) == 83.27
    ev = enrolment(parse_node_env(GOOD), "host-7", "0.1.0", host_uptime(tmp_path))
    envelope = Envelope.wrap("node.enrolled", ev.model_dump(mode="json"), producer="node-agent", correlation_id=ALLOC)
    default_validator().validate("gpuaas.node.bm-07.report.enrolled", envelope.model_dump(mode="json"))
    assert ev.boot_seconds == 83.27


def test_the_announcement_is_contract_valid_and_carries_only_the_tokens_proof() -> None:
    identity = parse_node_env(GOOD)
    ev = enrolment(identity, "host-7", "0.1.0")
    envelope = Envelope.wrap("node.enrolled", ev.model_dump(mode="json"), producer="node-agent", correlation_id=ALLOC)
    default_validator().validate("gpuaas.node.bm-07.report.enrolled", envelope.model_dump(mode="json"))
    payload = ev.model_dump(mode="json")
    assert payload["kind"] == "baremetal" and payload["enrolment_proof"] == token_proof(TOKEN)
    assert (payload["allocation_id"], payload["maas_system_id"]) == (ALLOC, "sys-7")
    assert TOKEN not in envelope.model_dump_json()
    ids = [announcement_id(identity, n) for n in range(4)]
    assert len(set(ids)) == 4 and announcement_id(identity, 0) == ids[0]
    assert [pause_before_repeat((1.0, 2.0), n) for n in (1, 2, 3, 9)] == [1.0, 2.0, 2.0, 2.0]


class FlakyBus:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[str] = []

    async def publish(self, type_, payload, *, correlation_id, event_id, node_id) -> None:
        assert (type_, node_id, correlation_id) == ("node.enrolled", "bm-07", ALLOC)
        self.sent.append(event_id)
        if self.failures:
            self.failures -= 1
            raise TimeoutError("no PubAck")


async def test_the_first_announcement_is_retried_under_one_id_then_repeated_until_the_deadline() -> None:
    identity = parse_node_env(GOOD)
    bus = FlakyBus(failures=2)
    agent = BaremetalHostAgent(
        identity, "h", "t", bus.publish, announce_again_s=(0.05,), announce_for_s=1.0, first_retry_max_s=0.05
    )
    await agent.run()  # returns at the deadline
    assert agent.enrolled
    first = announcement_id(identity, 0)
    assert bus.sent[:3] == [first, first, first]
    repeats = bus.sent[3:]
    assert repeats == [announcement_id(identity, n) for n in range(1, len(repeats) + 1)]
    assert 2 <= len(repeats) <= 20


async def test_a_host_that_cannot_announce_gives_up_at_its_deadline() -> None:
    bus = FlakyBus(failures=10_000)
    agent = BaremetalHostAgent(
        parse_node_env(GOOD),
        "h",
        "t",
        bus.publish,
        announce_again_s=(0.05,),
        announce_for_s=0.3,
        first_retry_max_s=0.05,
    )
    await agent.run()
    assert not agent.enrolled and set(bus.sent) == {announcement_id(parse_node_env(GOOD), 0)}
