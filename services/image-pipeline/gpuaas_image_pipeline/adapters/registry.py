"""Publishing artifacts to an OCI registry with the `oras` client.

oras covers what the pipeline needs: blob upload (monolithic or chunked POST/PATCH/PUT), existence
checks (a re-publish of the same content uploads nothing) and manifest upload. Its high-level
`push()` hashes each file again in 4 KiB reads before uploading; the pipeline already knows the
digest from packing, so it drives the lower-level calls itself and the data is read once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import oras.defaults
import oras.oci
import oras.provider

Progress = Callable[[int, int], None]
CONFIG_MEDIA_TYPE = "application/vnd.gpuaas.slice-image.config.v1+json"


class RegistryError(RuntimeError):
    pass


class _Registry(oras.provider.Registry):
    """oras' registry client, reporting upload progress per PATCH chunk."""

    def __init__(self, *args, progress: Progress | None = None, total: int = 0, **kw) -> None:
        super().__init__(*args, **kw)
        self._progress = progress
        self._total = total
        self._sent = 0

    def do_request(self, url, method="GET", data=None, headers=None, json=None, stream=False):  # noqa: A002
        response = super().do_request(url, method, data=data, headers=headers, json=json, stream=stream)
        if method == "PATCH" and isinstance(data, (bytes, bytearray)) and response.status_code < 300:
            self._sent += len(data)
            if self._progress:
                self._progress(self._sent, self._total)
        return response


def client(tls_mode: str, **kw) -> oras.provider.Registry:
    if tls_mode not in ("verify", "insecure", "plain-http"):
        raise RegistryError(f"unknown TLS mode {tls_mode!r}")
    return _Registry(insecure=tls_mode == "plain-http", tls_verify=tls_mode == "verify", **kw)


@dataclass(frozen=True)
class PushResult:
    manifest_digest: str
    uploaded: bool  # False when the registry already had the blob


def push_artifact(
    *,
    push_host: str,
    repository: str,
    tag: str,
    tls_mode: str,
    blob: Path,
    blob_digest: str,
    blob_size: int,
    media_type: str,
    title: str,
    config: dict,
    annotations: dict[str, str],
    chunk_size: int = 64 << 20,
    progress: Progress | None = None,
) -> PushResult:
    reg = client(tls_mode, progress=progress, total=blob_size)
    container = reg.get_container(f"{push_host}/{repository}:{tag}")
    layer = {
        "mediaType": media_type,
        "size": blob_size,
        "digest": f"sha256:{blob_digest}",
        "annotations": {oras.defaults.annotation_title: title},
    }
    existed = reg.blob_exists(layer, container)
    resp = reg.upload_blob(str(blob), container, layer, do_chunked=True, chunk_size=chunk_size)
    _check(resp, "blob upload")
    if progress:
        progress(blob_size, blob_size)
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    config_file = blob.with_name(blob.name + ".config.json")
    config_file.write_bytes(config_bytes)
    conf = {
        "mediaType": CONFIG_MEDIA_TYPE,
        "size": len(config_bytes),
        "digest": f"sha256:{hashlib.sha256(config_bytes).hexdigest()}",
    }
    _check(reg.upload_blob(str(config_file), container, conf), "config upload")
    config_file.unlink()
    manifest = oras.oci.NewManifest()
    manifest["config"] = conf
    manifest["layers"] = [layer]
    manifest["annotations"] = annotations
    resp = reg.upload_manifest(manifest, container)
    _check(resp, "manifest upload")
    digest = resp.headers.get("Docker-Content-Digest")
    if not digest:
        raise RegistryError("registry returned no manifest digest")
    return PushResult(digest, not existed)


def _check(resp, what: str) -> None:
    if resp.status_code not in (200, 201, 202):
        raise RegistryError(f"{what} failed: HTTP {resp.status_code} {resp.text[:500]}")
