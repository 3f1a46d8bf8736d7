"""Catalog rules. Pure."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SeedImage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slug: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    kind: str = Field(pattern=r"^(slice|host)$")
    sku: str
    digest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    image_path: str
    source_uri: str | None = None
    driver_strategy: str = "preinstalled"


def activation_event_key(slug: str, digest: str) -> str:
    """One activation announcement per (image, digest): re-seeding does not announce twice."""
    return f"image:{slug}:{digest}"


# --- activation gate ------------------------------------------------------------------------------

CacheState = tuple[str, str | None]  # (status, observed digest)


def node_schedulable(catalog_digest: str | None, cache: CacheState | None) -> bool:
    """A slice host may take slices on an image only with that exact digest verified in its cache."""
    return catalog_digest is not None and cache == ("verified", catalog_digest)


def activation_ready(catalog_digest: str | None, hosts: set[str], caches: dict[str, CacheState]) -> bool:
    """Every known slice host verified the catalog digest. No known host means nothing is proven yet."""
    return bool(hosts) and all(node_schedulable(catalog_digest, caches.get(h)) for h in hosts)


def activation_event_id_key(slug: str, digest: str, seq: int) -> str:
    """Each (re-)activation is announced once: a disable/enable cycle within JetStream's duplicate window
    must not be dropped as a repeat, so the activation sequence is part of the key."""
    return f"{activation_event_key(slug, digest)}:{seq}"


def default_tag(now: datetime) -> str:
    return now.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


@dataclass(frozen=True)
class ArtifactRef:
    host: str
    repository: str
    tag: str
    manifest_digest: str | None = None

    @property
    def uri(self) -> str:
        at = f"@{self.manifest_digest}" if self.manifest_digest else ""
        return f"oci://{self.host}/{self.repository}:{self.tag}{at}"

    @classmethod
    def parse(cls, uri: str) -> "ArtifactRef":
        m = _REF_RE.match(uri)
        if not m:
            raise ValueError(f"not an oci:// artifact reference: {uri!r}")
        return cls(m["host"], m["repo"], m["tag"], m["digest"])


_REF_RE = re.compile(
    r"^oci://(?P<host>[^/]+)/(?P<repo>[a-z0-9._/-]+):(?P<tag>[A-Za-z0-9_.-]{1,128})"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)


DRIVER_VERSION = r"^[0-9]+(\.[0-9]+){1,3}$"


class ImageCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slug: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=128)
    kind: str = Field(default="slice", pattern=r"^(slice|host)$")
    compatible_sku: str = Field(default="h200-sxm-slice", min_length=1, max_length=64)
    driver_strategy: str = Field(default="preinstalled", pattern=r"^(preinstalled|cloud_init)$")
    # The NVIDIA driver inside the guest: hosts placing NVLink partitions serve the image only with a Fabric
    # Manager of exactly this version. Kept in the metadata; None: unknown, no gate.
    driver_version: str | None = Field(default=None, pattern=DRIVER_VERSION, max_length=32)
    image_path: str | None = Field(default=None, max_length=1024)
    metadata: dict[str, Any] = Field(default_factory=dict)


class ImageUpdate(BaseModel):
    """What an operator may change in place. Digest and source come only from a build."""

    model_config = ConfigDict(extra="forbid")

    compatible_sku: str | None = Field(default=None, min_length=1, max_length=64)
    driver_strategy: str | None = Field(default=None, pattern=r"^(preinstalled|cloud_init)$")
    driver_version: str | None = Field(default=None, pattern=DRIVER_VERSION, max_length=32)
    metadata: dict[str, Any] | None = None


PROTECTED_METADATA = (
    "image_path",
    "artifact_ref",
    "blob_digest",
    "blob_size",
    "blob_media_type",
    "virtual_size",
    "build_id",
    "registry_tls",
    "maas",
    "host_builds",
    "installed_packages",
)


class BuildRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str | None = Field(default=None, max_length=4096)
    # A vendor image fetched over HTTP(S) and trusted once it matches its entry in the published checksum
    # list (SHA256SUMS format), in place of a local source.
    base_url: str | None = Field(default=None, max_length=4096, pattern=r"^https?://[^\s]+$")
    checksums_url: str | None = Field(default=None, max_length=4096, pattern=r"^https?://[^\s]+$")
    # The base image's sha256 pinned by whoever names it: trusted in place of (or besides) a signed list.
    base_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    # How the input image is opened: said, never probed (a probed format is the image's own choice, and
    # with it the backing file its header names). raw or qcow2 only.
    source_format: Literal["qcow2", "raw"] = "qcow2"
    # Virtual size the build's copy of the source is grown to (the guest grows its root into it).
    resize_gib: int | None = Field(default=None, ge=1, le=4096)
    reuse_build_id: str | None = None
    customise: str | None = Field(default=None, pattern=r"^(chroot|stamp|virt-customize|none)$")
    packages: list[str] = Field(default_factory=list, max_length=512)
    tag: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
    namespace: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9._/-]*$", max_length=255)
    dry_run: bool = False
    update_catalog: bool = True
    # Defaults for a slug that does not exist yet.
    compatible_sku: str = "h200-sxm-slice"
    driver_strategy: str = Field(default="preinstalled", pattern=r"^(preinstalled|cloud_init)$")

    def check(self, *, loopback_http: bool = False) -> None:
        """loopback_http: the lab's exception, plain http from a loopback host (the setting that names it)."""
        if sum(map(bool, (self.source, self.base_url, self.reuse_build_id))) != 1:
            raise ValueError("give exactly one of source or base_url (build) or reuse_build_id (republish an artifact)")
        if self.base_url and not (self.checksums_url or self.base_sha256):
            raise ValueError("base_url needs checksums_url (a signed SHA256SUMS) or base_sha256 (a pinned digest)")
        if (self.checksums_url or self.base_sha256) and not self.base_url:
            raise ValueError("checksums_url and base_sha256 go with base_url")
        for url in (self.base_url, self.checksums_url):
            if url and (why := url_refusal(url, loopback_http=loopback_http)):
                raise ValueError(why)
        if self.resize_gib and self.reuse_build_id:
            raise ValueError("resize_gib applies to a build, not to a republished artifact")


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_refusal(url: str, *, loopback_http: bool) -> str | None:
    """Why a base or checksum URL may not be fetched (None: it may): https only, but for the lab's loopback
    base when its setting allows it. Plain http lets anyone on the path hand over another image."""
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return None
    if parts.scheme == "http" and loopback_http and is_loopback_url(url):
        return None
    if parts.scheme == "http" and is_loopback_url(url):
        return f"{url} is plain http: only the lab's loopback base may be (GPUAAS_IMAGE_BASE_LOOPBACK_LAB)"
    return f"{url} is not an https URL"


_MAAS_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"


# What a host-upload does (the runbook's pipeline switches, as one field):
# build_and_upload  archive the tree, catalog the tgz, send the upload (the default; the pipeline's plain run)
# build_only        archive and catalog the tgz, send nothing (GPUAAS_MAAS_HOST_IMAGE_UPLOAD=0)
# upload_only       send a tgz built before, checked against its recorded sha256 (GPUAAS_MAAS_HOST_IMAGE_SKIP_BUILD=1)
# dry_run           check the request and the tree as a build would and say what it would do; write nothing
HOST_UPLOAD_MODES = ("build_and_upload", "build_only", "upload_only", "dry_run")
HostUploadMode = Literal["build_and_upload", "build_only", "upload_only", "dry_run"]
SHA256_HEX = r"^[0-9a-f]{64}$"


class HostUploadRequest(BaseModel):
    """Build a host rootfs tgz from a prepared root tree and have the MAAS gateway upload it as
    boot resource custom/<slug>; or only build it, only upload one built before, or plan it (`mode`)."""

    model_config = ConfigDict(extra="forbid")

    mode: HostUploadMode = "build_and_upload"
    # The tree to archive: every mode but upload_only, which reads no tree.
    rootfs: str | None = Field(default=None, min_length=1, max_length=4096)
    site_bootstrap: str | None = Field(default=None, max_length=4096)
    # upload_only: the built tgz to send, by its sha256; default: the one built last.
    sha256: str | None = Field(default=None, pattern=SHA256_HEX)
    site: str | None = Field(default=None, max_length=128, pattern=_MAAS_ID)
    title: str = Field(default="", max_length=256)
    architecture: str = Field(default="amd64/generic", pattern=r"^[a-z0-9]+/[a-z0-9.-]+$")
    base_image: str = Field(default="ubuntu/noble", pattern=r"^[a-z0-9]+/[a-z0-9.-]+$")
    # Defaults for a slug that does not exist yet.
    compatible_sku: str = Field(default="h200-sxm", min_length=1, max_length=64)
    driver_strategy: str = Field(default="preinstalled", pattern=r"^(preinstalled|cloud_init)$")

    @model_validator(mode="after")
    def _fits_mode(self) -> "HostUploadRequest":
        if self.mode == "upload_only":
            if self.rootfs is not None or self.site_bootstrap is not None:
                raise ValueError(
                    "upload_only sends a tgz built before and reads no tree: leave out rootfs and site_bootstrap"
                )
        else:
            if self.rootfs is None:
                raise ValueError(f"{self.mode} archives a root tree: rootfs is required")
            if self.sha256 is not None:
                raise ValueError("sha256 names a built tgz to reuse: upload_only only")
        return self

    @property
    def builds(self) -> bool:
        return self.mode in ("build_and_upload", "build_only")

    @property
    def uploads(self) -> bool:
        return self.mode in ("build_and_upload", "upload_only")


class ProfileImageRequest(BaseModel):
    """Point a MAAS site profile at this host image (distro_series omitted) or at any other series,
    e.g. `noble` to switch back to the stock image."""

    model_config = ConfigDict(extra="forbid")

    profile: str = Field(min_length=1, max_length=128, pattern=_MAAS_ID)
    site: str | None = Field(default=None, max_length=128, pattern=_MAAS_ID)
    distro_series: str | None = Field(default=None, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


def host_tgz_name(slug: str, sha256: str) -> str:
    """Content-addressed file name: a rebuild never rewrites a file an in-flight upload is still reading,
    and the same content lands on the same name."""
    return f"{slug}-{sha256[:16]}.tar.gz"


# --- built host tgz files ---------------------------------------------------------------------------

# How many built tgz files an image's catalog row remembers (newest first); older files stay on disk but can
# no longer be named for upload_only.
HOST_BUILDS_KEPT = 10


def record_host_build(builds: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The image's built tgz files with `entry` first. The same content built again keeps what was done with
    it (an upload already asked for stays asked for) and moves to the front."""
    before = next((b for b in builds if b.get("sha256") == entry["sha256"]), None)
    merged = {**entry, **({"status": before["status"], "operation_id": before.get("operation_id")} if before else {})}
    rest = [b for b in builds if b.get("sha256") != entry["sha256"]]
    return [merged, *rest][:HOST_BUILDS_KEPT]


def mark_host_build_uploading(builds: list[dict[str, Any]], sha256: str, operation_id: str) -> list[dict[str, Any]]:
    """The upload of one built tgz was asked for (its outcome is the image's `maas` record)."""
    return [
        {**b, "status": "upload_requested", "operation_id": operation_id} if b.get("sha256") == sha256 else b
        for b in builds
    ]


def pick_host_build(builds: list[dict[str, Any]], sha256: str | None) -> dict[str, Any] | None:
    """The built tgz upload_only sends: the one with this sha256, else the newest."""
    if sha256 is None:
        return builds[0] if builds else None
    return next((b for b in builds if b.get("sha256") == sha256), None)
