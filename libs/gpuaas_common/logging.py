"""structlog JSON logging with correlation ids carried in context variables.

Secrets are scrubbed by key name as a last line of defence; code should never bind them at all.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_SECRET_KEYS = ("api_key", "apikey", "token", "password", "secret", "authorization", "database_url")


def _scrub_secrets(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    for key in list(event_dict):
        lowered = key.lower()
        if any(s in lowered for s in _SECRET_KEYS):
            event_dict[key] = "**redacted**"
    return event_dict


def configure_logging(service: str, level: str = "INFO", stream: Any = None) -> None:
    logging.basicConfig(format="%(message)s", stream=stream or sys.stderr, level=level)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _scrub_secrets,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


bound_context = structlog.contextvars.bound_contextvars
