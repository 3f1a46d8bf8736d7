"""FastStream's two per-message lines are DEBUG lines; its other lines keep their level."""

from __future__ import annotations

import io
import json
import logging

import pytest

import gpuaas_common.bus  # noqa: F401 - installs the filter on the broker's logger
from gpuaas_common.logging import BROKER_LOGGER, configure_logging


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_received_and_processed_are_debug_lines(level: str) -> None:
    out = io.StringIO()
    configure_logging("probe", level, stream=out)
    try:
        broker = logging.getLogger(BROKER_LOGGER)
        broker.info("`OnMessage` waiting for messages", extra={"subject": "gpuaas.x"})
        broker.info("Received", extra={"subject": "gpuaas.x"})
        broker.info("Processed", extra={"subject": "gpuaas.x"})
        broker.error("ValueError: boom", extra={"subject": "gpuaas.x"})
    finally:
        configure_logging("probe", "INFO")
    lines = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    got = [(line["event"], line["level"]) for line in lines]
    per_message = [("Received", "debug"), ("Processed", "debug")] if level == "DEBUG" else []
    assert got == [("`OnMessage` waiting for messages", "info"), *per_message, ("ValueError: boom", "error")]
