"""Deploy: the site profile's image with user-data carrying the host's enrolment token and NATS creds."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpuaas_common.enrolment import enrolment_token

from ..adapters.credential_authority import AuthorityRefused
from ..adapters.host_credentials import HostCredentials
from ..domain.operations import normalise_distro_series
from .cloud_init import BootstrapNotCloudConfig, render_user_data
from .machine import machine_step
from .ports import Row
from .shared import Operations, Site, Unresolvable, as_dict


async def prepare(ops: Operations, site: Site, row: Row) -> Callable[[], Awaitable[Any]] | None:
    _, profile = await ops.profile(row["site"], row["profile"])
    # A host that served slices keeps its agent's creds file on a disk the tenant will own: MAAS erase leaves
    # most blocks in place, so those users must be dead before the machine is the tenant's. A slice-host
    # redeploy ends them too: the new OS gets a user of its own below.
    if not await ops.end_slice_identity(row):
        return None
    token = enrolment_token(
        ops.settings.enrolment_secret.get_secret_value(), str(row["allocation_id"]), row["system_id"]
    )
    creds = None
    if ops.host_credentials is not None:
        creds = await _host_creds(ops.host_credentials, row, slice_host=profile.slice_host)
    try:
        user_data = render_user_data(
            profile.bootstrap_user_data,
            token,
            str(row["allocation_id"]),
            row["node_id"],
            row["system_id"],
            creds,
            ssh_public_keys=as_dict(row["params"]).get("ssh_public_keys") or (),
            slice_host=profile.slice_host,
        )
    except BootstrapNotCloudConfig as exc:
        raise Unresolvable("invalid_bootstrap", f"site profile {row['profile']!r}: {exc}") from None
    series = normalise_distro_series(profile.distro_series, await ops.uploaded(row["site"]))

    async def submit() -> Any:
        if profile.storage_layout is not None:
            # Before the deploy, every time: a layout set again is no change, and a machine back from another
            # tenant may have been given another one.
            await site.client.set_storage_layout(row["system_id"], profile.storage_layout)
        return await site.client.deploy(
            row["system_id"],
            series,
            user_data=user_data,
            hwe_kernel=profile.hwe_kernel,
            agent_name=str(row["allocation_id"]),
            comment=(
                f"gpuaas slice-host redeploy {row['allocation_id']}"
                if profile.slice_host
                else f"gpuaas allocation {row['allocation_id']}"
            ),
        )

    return submit


async def _host_creds(host_credentials: HostCredentials, row: Row, *, slice_host: bool) -> str:
    """The host's user for this deploy, minted by the authority for the deploy command the operation came from.
    A refusal (no such command on the bus, one that asks for something else, or an allocation already ended: its
    users revoked by a release or a failed deploy) fails the deploy with the authority's code: asking again would be
    refused again."""
    seq = as_dict(row["params"]).get("command_seq")
    if not isinstance(seq, int):
        raise Unresolvable(
            "no_deploy_command", "the operation has no deploy command's stream sequence, so no host user can be minted"
        )
    try:
        return await host_credentials.issue(
            str(row["allocation_id"]), row["node_id"], command_seq=seq, slice_host=slice_host
        )
    except AuthorityRefused as refused:
        if refused.status != 403:
            raise
        raise Unresolvable(refused.code, f"the credential authority refused the host user: {refused.message}") from None


step = machine_step(prepare)
