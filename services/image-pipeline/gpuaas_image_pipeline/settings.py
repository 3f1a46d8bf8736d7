from typing import Literal

from pydantic import Field, SecretStr

from gpuaas_common.settings import ServiceSettings


class ImagePipelineSettings(ServiceSettings):
    # JSON list of catalog rows to make sure exist (slug, kind, sku, digest_sha256, image_path, source_uri).
    image_seed_file: str | None = None
    # Admin HTTP API (bearer token); port 0 picks a free one. No token configured = the API refuses everything.
    admin_host: str = "127.0.0.1"
    admin_port: int = Field(default=0, ge=0, le=65535)
    admin_token: SecretStr | None = None
    # Registry as recorded in the catalog (what nodes pull from) and, optionally, a separate endpoint used
    # only for the upload, so multi-GB pushes stay off public ingress.
    registry_host: str | None = None
    registry_push_host: str | None = None
    registry_namespace: str = "slice-guest-images"
    # Default tag: UTC build time.
    registry_tag: str | None = None
    registry_tls_mode: Literal["verify", "insecure", "plain-http"] = "verify"
    registry_chunk_mib: int = Field(default=64, ge=1, le=4096)
    # Where builds keep their work files (qcow2 copy, raw, packed artifact).
    image_build_dir: str = "/var/lib/gpuaas/image-builds"
    # Node-local slice image cache: the catalog's image_path is <dir>/<slug>.raw.
    image_cache_dir: str = "/var/lib/gpuaas/images"
    # Customisation plug-in: stamp (local, edits the image with qemu-io), virt-customize, none.
    image_customise: Literal["stamp", "virt-customize", "none"] = "stamp"
    image_install_packages: str = ""
    # MAAS host images (rootfs tgz) are written here and uploaded by the MAAS gateway, which reads the file
    # by its path: the gateway must see this directory at the same path (same host or a shared volume).
    host_image_dir: str = "/var/lib/gpuaas/maas-host-images"
    # The gateway's site a host image is uploaded to unless the request names one.
    maas_site: str = Field(default="default", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
