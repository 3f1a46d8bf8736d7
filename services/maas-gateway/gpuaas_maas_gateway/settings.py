from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationInfo, field_validator

from gpuaas_common.settings import EnvList, ServiceSettings

# An HMAC key anyone could guess would let any host enrol as any allocation's machine.
MIN_ENROLMENT_SECRET = 16


class SiteProfile(BaseModel):
    # A bare name of an uploaded image is sent to MAAS as custom/<name>; ops switch it at run time
    # with a set_distro_series command (stored per site, this is the default).
    distro_series: str = "noble"
    hwe_kernel: str | None = None
    bootstrap_user_data: str = ""
    # MAAS storage layout set before each deploy (`flat` for a tgz host image: MAAS owns the partitions and the
    # ESP, maas-host-image-pipeline); None leaves the machine's layout as MAAS has it.
    storage_layout: Literal["flat", "lvm", "bcache", "blank"] | None = "flat"
    # The image's default user, who gets the tenant's keys through cloud-init's `ssh_authorized_keys` and whom
    # the tenant logs in as (MAAS's Ubuntu images: `ubuntu`; a Debian image: `debian`).
    login_user: str = Field(default="ubuntu", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    # Tags that mark a machine as belonging to this profile in MAAS (synced by sync_tags).
    tags: tuple[str, ...] = ()
    # A slice host's profile (the scheduler's GPUAAS_SLICE_HOST_PROFILE names it): the deploy hands the host a
    # slice host's identity (a systemd drop-in for the node agent and its creds file) instead of a tenant's
    # enrolment file, whose presence would make the agent a baremetal one.
    slice_host: bool = False


class MaasSite(BaseModel):
    url: str
    api_key: SecretStr
    # None: the gateway-wide maas_max_concurrency.
    max_concurrency: int | None = Field(default=None, ge=1)


def _site_urls(data: dict[str, Any]) -> dict[str, str]:
    """Every site's URL among the fields validated so far, as `sites()` will name them."""
    urls = {name: site.url for name, site in (data.get("maas_sites") or {}).items()}
    key = data.get("maas_api_key")
    default = data.get("maas_default_site", "default")
    if key is not None and key.get_secret_value() and default not in urls and "maas_url" in data:
        urls[default] = data["maas_url"]
    return urls


class GatewaySettings(ServiceSettings):
    # The single-site settings: used as the site named `maas_default_site` unless `maas_sites` names it.
    maas_url: str = "http://127.0.0.1:5240/MAAS/"
    # That site's API key, `consumer:token:secret`; empty: no single site.
    maas_api_key: SecretStr = SecretStr("")
    # The name the single site goes by (what the allocator's GPUAAS_MAAS_SITE names).
    maas_default_site: str = "default"
    # Every other site: {"site": {"url": …, "api_key": "consumer:token:secret"}} (JSON in GPUAAS_MAAS_SITES).
    maas_sites: dict[str, MaasSite] = {}
    # The CA that signed every MAAS site's HTTPS certificate: only it is trusted (pinned), never the system store.
    # Required for https:// sites.
    maas_ca_file: str | None = Field(default=None, validate_default=True)
    # Allows http:// MAAS sites. The API key (OAuth PLAINTEXT) and every deploy's user-data, with the host's NATS
    # creds and enrolment token, then travel in clear: a local simulator only; logged as a warning at start.
    maas_insecure_http: bool = Field(default=False, validate_default=True)
    # Timeout of one MAAS API call.
    maas_timeout_s: float = Field(default=10.0, gt=0)
    # How often an unknown or accepted operation is observed; real MAAS clients use 5-10 s.
    maas_poll_interval_s: float = Field(default=1.0, gt=0)
    # How long a machine may still look untouched before an unknown submit counts as not accepted.
    maas_grace_s: float = Field(default=5.0, ge=0)
    # How long one MAAS operation (deploy, commission, upload) may take before it fails.
    maas_deadline_s: float = Field(default=1800.0, gt=0)
    # And a release: a drive without its own secure erase gets MAAS's full overwrite, hours for a host's NVMe disks
    # (tens of TB at a few GB/s, disk after disk); past it the release fails and the node stays drained for ops.
    maas_release_deadline_s: float = Field(default=12 * 3600.0, gt=0)
    # MAAS calls in flight per site, unless the site sets its own max_concurrency.
    maas_max_concurrency: int = Field(default=8, ge=1)
    # Retry-After is honoured up to this many seconds, so one odd header cannot park work for hours.
    maas_retry_after_cap_s: float = Field(default=120.0, ge=0)
    # Consecutive connection failures that open a site's circuit breaker.
    maas_breaker_failures: int = Field(default=3, ge=1)
    # How long an open breaker stays open before one call may try again.
    maas_breaker_cooldown_s: float = Field(default=10.0, gt=0)
    # python-libmaas uploads boot resources in 4 MiB chunks; so do we.
    maas_upload_chunk_bytes: int = Field(default=4 << 20, ge=1)
    # Custom images known to be uploaded to every site already (besides those the catalog records).
    maas_uploaded_images: EnvList[str] = ()
    # Series a profile may name without an upload (also as ubuntu/<series>); any other bare name
    # must be an uploaded image, at the site or in maas_uploaded_images.
    maas_stock_series: EnvList[str] = ("focal", "jammy", "noble")
    # Shared with the allocator: the HMAC key of the enrolment token put into a baremetal host's user_data. No
    # default: 16 characters or more, the allocator's value (`gpuaas dev up` and `scripts/compose-env.sh` make one).
    enrolment_secret: SecretStr
    # Bus identities for baremetal hosts come from the credential authority (gpuaas-credential-authority), the one
    # process holding the signing keys, at this https:// URL; the gateway signs each request with its own
    # GPUAAS_NATS_CREDS. Unset: deploys carry no NATS credentials (an open dev bus).
    credential_authority_url: str | None = Field(default=None, pattern=r"^https://")
    # The CA of the authority's certificate (the deployment's, as the NATS servers'); default GPUAAS_NATS_CA_FILE.
    credential_authority_ca_file: str | None = None
    # Lifetime of a baremetal host's NATS user; a release revokes it earlier.
    host_creds_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    # The commissioning script whose GPUAAS_SLICE_* output every commission's result is judged by
    # (runbook: scripts/maas/commissioning/50-gpuaas-slice-firmware-preflight.sh).
    maas_slice_preflight_script: str = "50-gpuaas-slice-firmware-preflight"
    # Deploy profiles by name (the allocator's GPUAAS_BAREMETAL_PROFILE picks one), JSON.
    site_profiles: dict[str, SiteProfile] = {"h200-baremetal": SiteProfile()}

    @field_validator("maas_ca_file")
    @classmethod
    def _https_is_pinned(cls, v: str | None, info: ValidationInfo) -> str | None:
        https = [name for name, url in _site_urls(info.data).items() if url.lower().startswith("https://")]
        if https and not v:
            raise ValueError(f"MAAS site {https[0]!r} is https:// and needs the CA its certificate is pinned to")
        return v

    @field_validator("maas_insecure_http")
    @classmethod
    def _no_plain_http(cls, v: bool, info: ValidationInfo) -> bool:
        for name, url in _site_urls(info.data).items():
            if not url.lower().startswith(("https://", "http://")):
                raise ValueError(f"MAAS site {name!r}: the URL must be https:// (or http:// with this setting)")
            if url.lower().startswith("http://") and not v:
                raise ValueError(
                    f"MAAS site {name!r} is plain http://, which carries the MAAS key and hosts' creds in clear: use "
                    "https:// with GPUAAS_MAAS_CA_FILE, or set GPUAAS_MAAS_INSECURE_HTTP=true for a local simulator"
                )
        return v

    @field_validator("enrolment_secret")
    @classmethod
    def _enrolment_secret_long_enough(cls, v: SecretStr) -> SecretStr:
        if len(v.get_secret_value()) < MIN_ENROLMENT_SECRET:
            raise ValueError(f"must be at least {MIN_ENROLMENT_SECRET} characters, the same as the allocator's")
        return v

    def sites(self) -> dict[str, MaasSite]:
        sites = dict(self.maas_sites)
        if self.maas_default_site not in sites and self.maas_api_key.get_secret_value():
            sites[self.maas_default_site] = MaasSite(url=self.maas_url, api_key=self.maas_api_key)
        return sites
