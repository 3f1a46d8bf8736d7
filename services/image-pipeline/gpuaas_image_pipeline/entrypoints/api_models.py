"""Response shapes of the image pipeline's admin API: the OpenAPI document is rendered from them and the
fuzz test holds every answer to them. Rows keep columns not named here (`extra="allow"`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Row(BaseModel):
    model_config = ConfigDict(extra="allow")


class ImageView(Row):
    slug: str
    kind: str
    status: str
    driver_strategy: str
    compatible_sku: str
    source_uri: str | None
    digest_sha256: str | None
    metadata: dict[str, Any]
    created_at: str
    updated_at: str


class NodeCache(Row):
    node_id: str
    status: str
    schedulable: bool


class BuildView(Row):
    build_id: str
    slug: str
    status: str
    created_at: str
    updated_at: str


class ImageDetail(ImageView):
    nodes: list[NodeCache]
    last_build: BuildView | None


class ImageList(BaseModel):
    images: list[ImageView]


class BuildList(BaseModel):
    builds: list[BuildView]


class Deleted(BaseModel):
    deleted: str


class Prewarm(BaseModel):
    slug: str
    prewarm_tasks: int


class MaasRequestView(Row):
    operation_id: str
    slug: str
    kind: str
    site: str
    status: str
    created_at: str
    updated_at: str


class MaasRequestList(BaseModel):
    requests: list[MaasRequestView]


class HostTreePlan(BaseModel):
    rootfs: str
    entries: int
    files: int
    file_bytes: int
    tar_bytes_estimate: int
    adds_curtin_marker: bool
    adds_site_bootstrap: bool
    skipped: list[str]


class HostUploadTarget(BaseModel):
    site: str
    name: str
    title: str
    architecture: str
    base_image: str
    filetype: str


class HostUploadPlan(BaseModel):
    """A dry run's answer: what build_and_upload would archive, write and ask of MAAS."""

    tree: HostTreePlan
    tgz_dir: str
    tgz_name: str
    free_bytes: int
    creates_image: bool
    upload: HostUploadTarget
    steps: list[str]


class HostUpload(BaseModel):
    mode: str
    # The catalog row after the request; a dry run's is the row as it is (None for a slug not catalogued).
    image: ImageView | None
    operation_id: str | None
    upload_sent: bool
    # The tgz built or reused (None in a dry run).
    sha256: str | None
    size: int | None
    source_path: str | None
    plan: HostUploadPlan | None
