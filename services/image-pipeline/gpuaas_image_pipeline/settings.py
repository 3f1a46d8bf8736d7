from typing import Literal

from pydantic import Field, SecretStr

from gpuaas_common.settings import ServiceSettings


class ImagePipelineSettings(ServiceSettings):
    # JSON list of catalog rows to make sure exist (slug, kind, sku, digest_sha256, image_path, source_uri).
    image_seed_file: str | None = None
    # Admin HTTP API address; 0.0.0.0 in a container so a published port reaches it.
    admin_host: str = "127.0.0.1"
    # 0 picks a free port (written into the ready file).
    admin_port: int = Field(default=0, ge=0, le=65535)
    # Bearer token of the admin API; without one the API does not listen.
    admin_token: SecretStr | None = None
    # Registry (host:port) as recorded in the catalog: what nodes pull from.
    registry_host: str | None = None
    # Optionally a separate endpoint used only for the upload, so multi-GB pushes stay off public ingress.
    registry_push_host: str | None = None
    # Repository path under the registry that image artifacts are pushed to.
    registry_namespace: str = "slice-guest-images"
    # Default tag: UTC build time.
    registry_tag: str | None = None
    # How the registry is spoken to: HTTPS with a verified certificate, HTTPS unverified, or plain HTTP.
    registry_tls_mode: Literal["verify", "insecure", "plain-http"] = "verify"
    # Size of each chunk of a blob upload.
    registry_chunk_mib: int = Field(default=64, ge=1, le=4096)
    # Comma-separated directories a build's `source` image must lie in (links resolved): an admin request
    # names a path, and the pipeline must not read any file of its host into a tenant's image.
    image_source_dirs: str = "/var/lib/gpuaas/image-sources"
    # Comma-separated directories a host image's `rootfs` tree and `site_bootstrap` must lie in (links resolved).
    host_rootfs_dirs: str = "/var/lib/gpuaas/host-rootfs"
    # Where builds keep their work files (qcow2 copy, raw, packed artifact).
    image_build_dir: str = "/var/lib/gpuaas/image-builds"
    # Node-local slice image cache: the catalog's image_path is <dir>/<slug>.raw.
    image_cache_dir: str = "/var/lib/gpuaas/slice-images"
    # Customisation plug-in: chroot (installs packages into the image's root with the guest's apt; nbd or loop
    # devices, virt-customize as the fallback), virt-customize, none; stamp is a dev option that only writes
    # a build stamp into the disk (no root, no real image needed): the dev stack names it, production builds
    # default to the real customiser.
    image_customise: Literal["chroot", "stamp", "virt-customize", "none"] = "chroot"
    # Comma-separated packages a build installs when the request names none (chroot and virt-customize).
    image_install_packages: str = "cloud-init,openssh-server,qemu-guest-agent"
    # Base images fetched from a URL (BuildRequest.base_url), kept by digest.
    image_base_cache_dir: str = "/var/lib/gpuaas/base-images"
    # OpenPGP keyring (a file gpgv --keyring reads, e.g. ubuntu-cloudimage-keyring.gpg) that a base image's
    # SHA256SUMS.gpg must verify against; unset: only base images with a pinned base_sha256 are built.
    image_base_keyring: str | None = None
    # The lab's exception: base and checksum URLs on a loopback host may be plain http with an unsigned list
    # (the lab serves its own base image from this machine). Never for any other host.
    image_base_loopback_lab: bool = False
    # Limits of each qemu-img run on an input image (prlimit): address space and CPU time.
    image_tool_max_memory_mib: int = Field(default=8192, ge=256)
    # CPU seconds one qemu-img run on an input image may use before the kernel stops it.
    image_tool_max_cpu_s: int = Field(default=7200, ge=10)
    # MAAS host images (rootfs tgz) are written here and uploaded by the MAAS gateway, which reads the file
    # by its path: the gateway must see this directory at the same path (same host or a shared volume).
    host_image_dir: str = "/var/lib/gpuaas/maas-host-images"
    # The gateway's site a host image is uploaded to unless the request names one.
    maas_site: str = Field(default="default", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
