"""MAAS commands published as their producers publish them (the allocator's and the scheduler's own identities),
for tests of the credential authority, which mints a host user only for a deploy command it reads on the bus."""

from __future__ import annotations

import uuid
from typing import Any

import nats

from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_common.identity import Authority
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS
from gpuaas_common.identity.tls import TlsFiles
from gpuaas_dev.testing.nats_clients import connect_as


async def publish_command(
    nc: nats.NATS, type_: str, *, producer: str, node_id: str, allocation_id: str, **fields: Any
) -> int:
    """Publishes one command (validated against the contract first) and returns its sequence in the MAAS stream."""
    spec = spec_for(type_)
    operation = f"op-{uuid.uuid4().hex[:12]}"
    base: dict[str, Any] = {
        "operation_id": operation,
        "allocation_id": allocation_id,
        "site": "default",
        "system_id": "abc123",
        "node_id": node_id,
    }
    if type_ == "maas.deploy_requested":
        base["profile"] = "h200-baremetal"
    payload = spec.model.model_validate(base | fields).model_dump(mode="json")
    envelope = Envelope.wrap(type_, payload, producer=producer, correlation_id=operation)
    body = envelope.model_dump_json()
    default_validator().validate(spec.address, body)
    ack = await nc.jetstream().publish(spec.address, body.encode(), headers={"Nats-Msg-Id": envelope.event_id})
    assert ack.stream == "MAAS"
    return int(ack.seq)


class Deploys:
    """The allocator and the scheduler on the bus, each with its own identity."""

    def __init__(self, allocator: nats.NATS, scheduler: nats.NATS) -> None:
        self.allocator = allocator
        self.scheduler = scheduler

    @classmethod
    async def connect(cls, url: str, tls: TlsFiles, authority: Authority) -> Deploys:
        allocator = await connect_as(url, tls.ca, authority.issue_user("allocator", ROLE_PERMISSIONS["allocator"]))
        scheduler = await connect_as(url, tls.ca, authority.issue_user("scheduler", ROLE_PERMISSIONS["scheduler"]))
        return cls(allocator, scheduler)

    async def close(self) -> None:
        await self.allocator.close()
        await self.scheduler.close()

    async def tenant(self, node_id: str, allocation_id: str) -> int:
        """The allocator's deploy of `node_id` for a tenant's allocation."""
        return await publish_command(
            self.allocator, "maas.deploy_requested", producer="allocator", node_id=node_id, allocation_id=allocation_id
        )

    async def walk(self, node_id: str, walk_id: str) -> int:
        """The scheduler's slice-host redeploy of `node_id` in the host walk `walk_id`."""
        return await publish_command(
            self.scheduler,
            "maas.deploy_requested",
            producer="scheduler",
            node_id=node_id,
            allocation_id=walk_id,
            profile="slice-host",
        )

    async def release(self, node_id: str, allocation_id: str) -> int:
        return await publish_command(
            self.allocator, "maas.release_requested", producer="allocator", node_id=node_id, allocation_id=allocation_id
        )
