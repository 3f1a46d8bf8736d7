"""How a MAAS operation is resolved from what the machine shows. Pure.

A timed-out mutation is never repeated on a guess: the machine's observed state decides whether it
was accepted, failed, or (only after a grace period of looking untouched) may be submitted again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Status names as MAAS reports them (status_name).
DEPLOYED, DEPLOYING, FAILED_DEPLOYMENT = "Deployed", "Deploying", "Failed deployment"
READY, ALLOCATED = "Ready", "Allocated"
RELEASING, DISK_ERASING = "Releasing", "Disk erasing"
FAILED_RELEASING, FAILED_DISK_ERASING = "Releasing failed", "Failed disk erasing"


class Decision(enum.Enum):
    SUCCEEDED = "succeeded"
    ACCEPTED = "accepted"
    FAILED = "failed"
    WAIT = "wait"
    RESUBMIT = "resubmit"


def decide(kind: str, state: str, status_name: str, untouched_for_s: float | None, grace_s: float) -> Decision:
    """`state` is the operation's (unknown or accepted); `untouched_for_s` counts from the unknown call."""
    if kind == "deploy":
        done, working, failed = {DEPLOYED}, {DEPLOYING}, {FAILED_DEPLOYMENT}
        untouched = {READY, ALLOCATED}
    elif kind == "release":
        done, working, failed = {READY}, {RELEASING, DISK_ERASING}, {FAILED_RELEASING, FAILED_DISK_ERASING}
        untouched = {DEPLOYED, ALLOCATED, FAILED_DEPLOYMENT, DEPLOYING}
    else:
        raise ValueError(f"unknown operation kind {kind}")
    if status_name in done:
        return Decision.SUCCEEDED
    if status_name in working:
        return Decision.ACCEPTED
    if status_name in failed:
        return Decision.FAILED
    if status_name in untouched:
        if state == "accepted":
            # MAAS took the change and then the machine went back: that is a failure, not a retry.
            return Decision.FAILED
        if untouched_for_s is not None and untouched_for_s >= grace_s:
            return Decision.RESUBMIT
        return Decision.WAIT
    return Decision.FAILED


def normalise_distro_series(name: str, uploaded: tuple[str, ...] | frozenset[str]) -> str:
    """A bare name of an uploaded image must be sent as custom/<name>; stock series pass through."""
    if name.startswith("custom/"):
        return name
    return f"custom/{name}" if name in uploaded else name


COMMISSIONING, TESTING = "Commissioning", "Testing"
FAILED_COMMISSIONING, FAILED_TESTING = "Failed commissioning", "Failed testing"


def decide_commission(
    state: str,
    status_name: str,
    result_id: int | None,
    baseline_id: int | None,
    untouched_for_s: float | None,
    grace_s: float,
) -> Decision:
    """A commissioning run is proved by a new commissioning result id, since a machine that finished
    commissioning is Ready again, exactly like one that never started."""
    started = result_id is not None and result_id != baseline_id
    if status_name in (COMMISSIONING, TESTING):
        return Decision.ACCEPTED
    if started and status_name == READY:
        return Decision.SUCCEEDED
    if started and status_name in (FAILED_COMMISSIONING, FAILED_TESTING):
        return Decision.FAILED
    if not started:
        if state == "accepted":
            return Decision.FAILED
        if untouched_for_s is not None and untouched_for_s >= grace_s:
            return Decision.RESUBMIT
        return Decision.WAIT
    return Decision.FAILED


def image_name(name: str) -> str:
    """The name MAAS lists an uploaded boot resource under (`custom/` is not stored)."""
    return name.removeprefix("custom/")


# MAAS erases a released machine's disks with its `wipe-disks` release script; the run's result set (type
# Release) is the read-back of the erase, which the machine's status alone is not: a release without erase also
# ends Ready, and a poll can miss the Disk erasing phase between two looks.
ERASE_PASSED = frozenset({"Passed"})
ERASE_FAILED = frozenset({"Failed", "Timed out", "Aborted", "Failed installing dependencies"})
ERASE_RUNNING = frozenset({"Pending", "Running", "Installing dependencies"})


@dataclass(frozen=True)
class ReleaseVerdict:
    released: bool
    erase_outcome: str  # erased | failed | unconfirmed (the contract's EraseOutcome)
    reason_code: str | None
    message: str


def release_verdict(status_name: str, erase_set_status: str | None) -> ReleaseVerdict | None:
    """A finished release judged with its erase's result set (the newest release set started after the submit;
    None when there is none). Ready is a release only with the erase proven; Failed disk erasing (or a failed
    set) is a failed erase; Ready with no finished erase run is unconfirmed, so a failed release as well: nothing
    shows the disks were erased. None: the set still runs, look again."""
    if erase_set_status in ERASE_RUNNING and status_name != FAILED_DISK_ERASING:
        return None
    if status_name == FAILED_DISK_ERASING or erase_set_status in ERASE_FAILED:
        return ReleaseVerdict(False, "failed", "disk_erase_failed", f"MAAS disk erase failed (machine {status_name})")
    if status_name == READY and erase_set_status in ERASE_PASSED:
        return ReleaseVerdict(True, "erased", None, "disks erased")
    if status_name == READY:
        return ReleaseVerdict(
            False, "unconfirmed", "disk_erase_unconfirmed", "machine is Ready but MAAS shows no finished disk erase"
        )
    erased = "erased" if erase_set_status in ERASE_PASSED else "unconfirmed"
    return ReleaseVerdict(False, erased, "maas_failed", f"machine is {status_name}")
