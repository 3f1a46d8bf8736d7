"""Catalog rules. Pure."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
