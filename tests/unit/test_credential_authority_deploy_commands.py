"""A host user is minted only for what a deploy command on the bus asks (issue 38, point 4): the rule
(`gpuaas_credential_authority.domain.deploy_commands`), one row per refusal and per accepted mint; and none for an
allocation that has ended."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_credential_authority.domain.deploy_commands import (
    DeployCommandRefused,
    MintAsked,
    Minting,
    StoredMessage,
    check_allocation_open,
    check_deploy_command,
)

NOW = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
MAX_AGE_S = 3 * 3600.0
NODE = "bm:01"
ALLOCATION = str(uuid.uuid4())
DEPLOY = spec_for("maas.deploy_requested").address
RELEASE = spec_for("maas.release_requested").address


def command(type_: str = "maas.deploy_requested", producer: str = "allocator", **changes: Any) -> bytes:
    fields: dict[str, Any] = {
        "operation_id": "op-1",
        "allocation_id": ALLOCATION,
        "site": "default",
        "system_id": "abc123",
        "node_id": NODE,
    }
    if type_ == "maas.deploy_requested":
        fields["profile"] = "h200-baremetal"
    payload = spec_for(type_).model.model_validate(fields | changes).model_dump(mode="json")
    body = Envelope.wrap(type_, payload, producer=producer, correlation_id="op-1").model_dump_json()
    default_validator().validate(spec_for(type_).address, body)  # as the bus carries it: valid by the contract
    return body.encode()


def stored(body: bytes, subject: str = DEPLOY, age_s: float = 60.0) -> StoredMessage:
    return StoredMessage(subject, body, NOW - timedelta(seconds=age_s))


def host_user(node: str = NODE, allocation: str = ALLOCATION) -> MintAsked:
    return MintAsked(Minting.HOST_USER, node, allocation, deploy_command_seq=41)


def slice_host_user(node: str = NODE, walk: str = ALLOCATION) -> MintAsked:
    return MintAsked(Minting.SLICE_HOST_USER, node, walk, deploy_command_seq=41)


BROKEN_ENVELOPE = json.dumps({"type": "maas.deploy_requested", "producer": "allocator"}).encode()
BAD_PAYLOAD = json.loads(command())
BAD_PAYLOAD["payload"]["allocation_id"] = "not-a-uuid"


@pytest.mark.parametrize(
    ("message", "asked", "code"),
    [
        pytest.param(None, host_user(), "no_deploy_command", id="a-made-up-seq"),
        pytest.param(
            stored(command("maas.release_requested"), RELEASE), host_user(), "no_deploy_command", id="release"
        ),
        pytest.param(stored(b"not json"), host_user(), "deploy_command_invalid", id="not-json"),
        pytest.param(stored(BROKEN_ENVELOPE), host_user(), "deploy_command_invalid", id="no-envelope"),
        pytest.param(
            stored(json.dumps(BAD_PAYLOAD).encode()), host_user(), "deploy_command_invalid", id="payload-invalid"
        ),
        pytest.param(stored(command()), host_user(node="bm:02"), "deploy_command_mismatch", id="another-node"),
        pytest.param(
            stored(command()), host_user(allocation=str(uuid.uuid4())), "deploy_command_mismatch", id="another-alloc"
        ),
        pytest.param(
            stored(command(producer="scheduler")), host_user(), "deploy_command_mismatch", id="host-user-by-scheduler"
        ),
        pytest.param(
            stored(command(producer="maas-gateway")), host_user(), "deploy_command_mismatch", id="another-producer"
        ),
        pytest.param(stored(command()), slice_host_user(), "deploy_command_mismatch", id="slice-host-by-allocator"),
        pytest.param(
            stored(command(producer="scheduler")),
            slice_host_user(walk=str(uuid.uuid4())),
            "deploy_command_mismatch",
            id="another-walk",
        ),
        pytest.param(
            stored(command(producer="scheduler")),
            slice_host_user(node="bm:02"),
            "deploy_command_mismatch",
            id="walk-node",
        ),
        pytest.param(stored(command(), age_s=MAX_AGE_S + 1), host_user(), "deploy_command_expired", id="old-command"),
    ],
)
def test_a_mint_no_deploy_command_asks_for_is_refused_with_a_stable_code(
    message: StoredMessage | None, asked: MintAsked, code: str
) -> None:
    with pytest.raises(DeployCommandRefused) as refused:
        check_deploy_command(message, asked, now=NOW, max_age_s=MAX_AGE_S)
    assert refused.value.code == code
    assert "41" in str(refused.value)  # the message names the sequence the caller gave


@pytest.mark.parametrize(
    ("message", "asked"),
    [
        pytest.param(stored(command()), host_user(), id="the-allocators-deploy"),
        pytest.param(stored(command()), host_user(allocation=ALLOCATION.upper()), id="uuid-case-is-no-difference"),
        pytest.param(stored(command(producer="scheduler")), slice_host_user(), id="the-schedulers-walk"),
        pytest.param(stored(command(), age_s=MAX_AGE_S - 1), host_user(), id="just-in-time"),
    ],
)
def test_the_deploy_command_that_asks_for_the_mint_lets_it_through(message: StoredMessage, asked: MintAsked) -> None:
    check_deploy_command(message, asked, now=NOW, max_age_s=MAX_AGE_S)


def test_a_mint_for_an_ended_allocation_is_refused_whatever_its_ids_case() -> None:
    ended_at = int(NOW.timestamp())
    with pytest.raises(DeployCommandRefused) as refused:
        check_allocation_open(ALLOCATION.upper(), {ALLOCATION.lower(): ended_at, str(uuid.uuid4()): ended_at})
    assert refused.value.code == "allocation_ended"
    assert NOW.isoformat() in str(refused.value)  # when it ended


def test_a_mint_for_an_allocation_not_ended_goes_on() -> None:
    check_allocation_open(ALLOCATION, {str(uuid.uuid4()): int(NOW.timestamp())})
