"""`gpuaas-image-pipeline`'s command line (gpuaas_common.service_args): the heavy main is imported only to run."""

from __future__ import annotations

from gpuaas_common.service_args import service_main

from ..settings import ImagePipelineSettings

SUMMARY = (
    "The image catalog, builds and publishing, node cache prewarm and the activation gate, and its admin HTTP API."
)


def main() -> None:
    service_main("gpuaas-image-pipeline", SUMMARY, ImagePipelineSettings, "gpuaas_image_pipeline.entrypoints.main:main")
