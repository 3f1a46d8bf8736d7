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


class HostUpload(BaseModel):
    image: ImageView
    operation_id: str | None
    upload_sent: bool
    sha256: str
    size: int
