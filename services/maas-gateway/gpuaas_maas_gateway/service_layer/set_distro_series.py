"""Switch the image a site profile deploys: a stock series, or a custom image MAAS has complete."""

from __future__ import annotations

from gpuaas_common.logging import get_logger

from ..domain.operations import image_name, normalise_distro_series
from .ports import GatewayRepositories, Row
from .shared import Operations, Site, Unresolvable, params

log = get_logger(__name__)


async def step(ops: Operations, site: Site, row: Row) -> None:
    profile_name, profile = await ops.profile(row["site"], row["profile"])
    wanted = params(row)["distro_series"]
    uploaded = await ops.uploaded(row["site"])
    osystem, _, series = wanted.rpartition("/")
    stock = osystem in ("", "ubuntu") and series in ops.settings.maas_stock_series
    if not stock and osystem not in ("", "custom"):
        raise Unresolvable("unknown_distro_series", f"{wanted!r} is neither a stock series nor an upload")
    if not stock and image_name(wanted) not in uploaded:
        # Uploaded outside the gateway is fine too, as long as MAAS has it complete.
        listed = await ops.maas(site, site.client.list_boot_resources)
        names = {image_name(r.get("name", "")) for r in listed}
        if image_name(wanted) not in names:
            raise Unresolvable(
                "image_not_uploaded", f"no boot resource custom/{image_name(wanted)} at site {row['site']}"
            )
        uploaded = uploaded | {image_name(wanted)}
    stored = wanted if stock else image_name(wanted)

    async def store(repos: GatewayRepositories) -> None:
        await repos.catalog.set_distro_series(row["site"], profile_name, stored, row["operation_id"])

    log.info("profile_distro_series_set", profile=profile_name, previous=profile.distro_series, now=stored)
    await ops.finish(
        row,
        "succeeded",
        during=store,
        result={
            "profile": profile_name,
            "distro_series": stored,
            "previous_distro_series": profile.distro_series,
            "deploy_distro_series": normalise_distro_series(stored, uploaded),
        },
    )
