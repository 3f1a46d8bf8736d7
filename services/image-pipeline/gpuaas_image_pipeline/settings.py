from gpuaas_common.settings import ServiceSettings


class ImagePipelineSettings(ServiceSettings):
    # JSON list of catalog rows to make sure exist (slug, kind, sku, digest_sha256, image_path, source_uri).
    image_seed_file: str | None = None
