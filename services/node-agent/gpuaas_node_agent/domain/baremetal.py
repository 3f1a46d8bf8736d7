"""The baremetal role's rules: which role a host runs, what cloud-init's env file must say, and what the host
announces when it enrols. Pure: the file is read by adapters/node_env.py, the loop is service_layer/baremetal.py.

The file is the one the MAAS gateway writes through the deploy's user-data
(gpuaas_maas_gateway.service_layer.cloud_init); its path and keys are the contract between the two.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Literal

from gpuaas_common.contract import derived_event_id
from gpuaas_common.contract import messages as m
from gpuaas_common.enrolment import token_proof

NODE_ENV_PATH = "/etc/gpuaas/node-agent.env"

Role = Literal["slice_host", "baremetal"]
RoleSetting = Literal["auto", "slice_host", "baremetal"]

_LINE = re.compile(r"^(GPUAAS_[A-Z0-9_]+)=(.*)$")
# As the contract's Identifier: the node id becomes a subject token and a NATS user name.
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# What gpuaas_common.enrolment.enrolment_token makes: an HMAC-SHA256 in hex.
_TOKEN = re.compile(r"^[0-9a-f]{64}$")
_REQUIRED = ("GPUAAS_NODE_ID", "GPUAAS_ALLOCATION_ID", "GPUAAS_MAAS_SYSTEM_ID", "GPUAAS_ENROLMENT_TOKEN")


class NodeEnvInvalid(ValueError):
    """The env file is unusable. The message names the key or line, never a value: the token is a secret."""


class RoleRefused(ValueError):
    pass


@dataclass(frozen=True)
class BaremetalIdentity:
    node_id: str
    allocation_id: uuid.UUID
    maas_system_id: str
    token: str
    # The host path of the allocation-bound creds file, when the deploy carried one.
    creds_path: str | None

    def __repr__(self) -> str:  # the token stays out of logs and tracebacks
        return f"BaremetalIdentity(node_id={self.node_id!r}, allocation_id={str(self.allocation_id)!r})"


def choose_role(setting: RoleSetting, env_file_present: bool) -> Role:
    """`auto` follows the deploy: only a MAAS deploy for a tenant writes the env file, so its presence is what
    makes a host baremetal. An explicit setting that contradicts the file is refused rather than obeyed: a
    tenant's machine must never offer itself for slices, and a baremetal agent without its file has no
    identity to enrol with."""
    if setting == "auto":
        return "baremetal" if env_file_present else "slice_host"
    if setting == "slice_host" and env_file_present:
        raise RoleRefused(
            f"GPUAAS_ROLE=slice_host, but {NODE_ENV_PATH} is there: this host was deployed to a tenant as a "
            "baremetal host and cannot enrol as a slice host"
        )
    if setting == "baremetal" and not env_file_present:
        raise RoleRefused(
            f"GPUAAS_ROLE=baremetal, but there is no {NODE_ENV_PATH}: the deploy's user-data did not reach this host"
        )
    return setting


def parse_node_env(text: str) -> BaremetalIdentity:
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise NodeEnvInvalid(f"{NODE_ENV_PATH} line {number} is not a GPUAAS_NAME=value line")
        values[match.group(1)] = match.group(2).strip()
    missing = [key for key in _REQUIRED if not values.get(key)]
    if missing:
        raise NodeEnvInvalid(f"{NODE_ENV_PATH} has no {', '.join(missing)}")
    if not _NODE_ID.match(values["GPUAAS_NODE_ID"]):
        raise NodeEnvInvalid(f"{NODE_ENV_PATH}: GPUAAS_NODE_ID is not a node id")
    try:
        allocation_id = uuid.UUID(values["GPUAAS_ALLOCATION_ID"])
    except ValueError:
        raise NodeEnvInvalid(f"{NODE_ENV_PATH}: GPUAAS_ALLOCATION_ID is not a UUID") from None
    if not _NODE_ID.match(values["GPUAAS_MAAS_SYSTEM_ID"]):
        raise NodeEnvInvalid(f"{NODE_ENV_PATH}: GPUAAS_MAAS_SYSTEM_ID is not a MAAS system id")
    if not _TOKEN.match(values["GPUAAS_ENROLMENT_TOKEN"]):
        raise NodeEnvInvalid(f"{NODE_ENV_PATH}: GPUAAS_ENROLMENT_TOKEN is not the 64 hex digits the gateway writes")
    creds = values.get("GPUAAS_NATS_CREDS") or None
    if creds is not None and not creds.startswith("/"):
        raise NodeEnvInvalid(f"{NODE_ENV_PATH}: GPUAAS_NATS_CREDS is not an absolute path")
    return BaremetalIdentity(
        node_id=values["GPUAAS_NODE_ID"],
        allocation_id=allocation_id,
        maas_system_id=values["GPUAAS_MAAS_SYSTEM_ID"],
        token=values["GPUAAS_ENROLMENT_TOKEN"],
        creds_path=creds,
    )


def enrolment(
    identity: BaremetalIdentity, hostname: str, agent_version: str, boot_seconds: float | None = None
) -> m.NodeEnrolled:
    """Only the token's hash travels; the allocator recomputes it from its secret (gpuaas_common.enrolment).
    `boot_seconds`: the host's uptime as the agent starts, its first boot on its own clock."""
    return m.NodeEnrolled(
        boot_seconds=boot_seconds,
        node_id=identity.node_id,
        kind="baremetal",
        hostname=hostname,
        agent_version=agent_version,
        maas_system_id=identity.maas_system_id,
        allocation_id=identity.allocation_id,
        enrolment_proof=token_proof(identity.token),
    )


def announcement_id(identity: BaremetalIdentity, repeat: int) -> str:
    """The first announcement keeps one id however often it is retried (JetStream drops the copies); each
    repeat has its own, or the server would drop it as a duplicate of the first within its window."""
    suffix = f":{repeat}" if repeat else ""
    event_id: str = derived_event_id(str(identity.allocation_id), f"enrolled:{identity.node_id}{suffix}")
    return event_id


def pause_before_repeat(pauses: tuple[float, ...], repeat: int) -> float:
    """The wait before repeat `repeat` (1-based); the last pause goes on repeating."""
    return pauses[min(repeat - 1, len(pauses) - 1)]
