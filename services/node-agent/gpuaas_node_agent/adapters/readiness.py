"""Is the new VM reachable? The DHCP lease of its MAC shows the expected IP, and SSH answers there.

The lease comes from dnsmasq's lease file, not libvirt: the VM sits on an OVS bridge that libvirt does
not manage, so libvirt never sees the lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from pydantic import BaseModel, Field

from gpuaas_common.logging import get_logger

from .dnsmasq import find_lease
from .guest_ssh import LoginOutcome

log = get_logger(__name__)

LeaseState = Literal["bound", "absent", "mismatch"]


class Readiness(BaseModel):
    mac: str
    expected_ip: str
    actual_ip: str | None
    lease_state: LeaseState
    ssh_ready: bool
    host_key_mismatch: bool = False
    detail: str | None = None
    # What the login read of the guest's GPUs (its report as written), and whether the last login found none.
    gpu_report: str | None = None
    gpu_report_missing: bool = False
    # Seconds from the start of the wait to the lease (`lease`), then to sshd's banner (`ssh`), then to a login
    # that found cloud-init done (`cloud_init`); only the steps that happened.
    phase_seconds: dict[str, float] = Field(default_factory=dict)


Login = Callable[[str], Awaitable[LoginOutcome]]


async def probe_ssh_banner(ip: str, port: int, timeout_s: float) -> bool:
    """True when a TCP connection to (ip, port) gets an SSH-2.0 identification line (SSH-1.99 also speaks 2.0).
    RFC 4253 lets a server send other lines first, so a few are skipped."""
    if timeout_s <= 0:
        return False
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(ip, port)
            for _ in range(8):
                line = await reader.readline()
                if not line:
                    return False
                if line.startswith((b"SSH-2.0-", b"SSH-1.99-")):
                    return True
            return False
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


async def wait_ready(
    lease_file: str,
    mac: str,
    expected_ip: str,
    ssh_port: int,
    deadline_s: float,
    *,
    poll_interval_s: float = 0.25,
    connect_timeout_s: float = 2.0,
    login: Login | None = None,
) -> Readiness:
    """Wait up to `deadline_s` seconds for the lease of `mac` to show `expected_ip`, for SSH to answer there and,
    with `login`, for a login that proves the host key, finds cloud-init done and reads the guest's GPU report.
    Always returns within the deadline (plus one connect or login timeout at most) with the last observation; the
    caller decides what a not-ready result means. A host key that is not the planted one ends the wait at once: it
    will not change."""
    mac = mac.strip().lower()
    start = time.monotonic()
    deadline = start + deadline_s
    lease_state: LeaseState = "absent"
    actual_ip: str | None = None
    ssh_ready = False
    outcome: LoginOutcome | None = None  # the last login's
    seconds: dict[str, float] = {}
    last_logged: tuple[LeaseState, str | None] | None = None

    def mark(step: str) -> None:
        if step not in seconds:
            seconds[step] = round(time.monotonic() - start - sum(seconds.values()), 3)

    while True:
        lease = await asyncio.to_thread(find_lease, lease_file, mac)
        if lease is None:
            lease_state, actual_ip = "absent", None
        elif lease.ip == expected_ip:
            lease_state, actual_ip = "bound", lease.ip
        else:
            lease_state, actual_ip = "mismatch", lease.ip
        if (lease_state, actual_ip) != last_logged:
            log.info("readiness_lease", mac=mac, expected_ip=expected_ip, actual_ip=actual_ip, lease_state=lease_state)
            last_logged = (lease_state, actual_ip)

        remaining = deadline - time.monotonic()
        if lease_state == "bound":
            mark("lease")
            banner = await probe_ssh_banner(expected_ip, ssh_port, min(connect_timeout_s, max(remaining, 0.0)))
            if banner:
                mark("ssh")
                if login is None:
                    ssh_ready = True
                    break
                outcome = await login(expected_ip)
                if outcome.ok:
                    mark("cloud_init")
                    ssh_ready = True
                    break
                if outcome.host_key_mismatch:
                    break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        await asyncio.sleep(min(poll_interval_s if not (outcome and outcome.detail) else 1.0, remaining))

    result = Readiness(
        mac=mac,
        expected_ip=expected_ip,
        actual_ip=actual_ip,
        lease_state=lease_state,
        ssh_ready=ssh_ready,
        host_key_mismatch=bool(outcome and outcome.host_key_mismatch),
        detail=(outcome.detail or None) if outcome else None,
        gpu_report=outcome.gpu_report if outcome and outcome.ok else None,
        gpu_report_missing=bool(outcome and outcome.report_missing),
        phase_seconds=seconds,
    )
    (log.info if ssh_ready else log.warning)("readiness_result", **result.model_dump(exclude={"gpu_report"}))
    return result
