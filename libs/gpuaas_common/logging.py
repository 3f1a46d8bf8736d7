"""structlog JSON logging with correlation ids carried in context variables.

Every line a process writes is one JSON object: structlog's own events and, through the root handler,
every stdlib logger's records (nats-py's, asyncpg's, asyncio's) rendered by the same processors.
Secrets are scrubbed by key name as a last line of defence; code should never bind them at all.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import structlog

_SECRET_KEYS = ("api_key", "apikey", "token", "password", "secret", "authorization", "database_url")


@functools.lru_cache(maxsize=4096)
def _is_secret_key(key: str) -> bool:
    # Cached: a process logs a few dozen key names, and every line used to test each against every marker.
    lowered = key.lower()
    return any(s in lowered for s in _SECRET_KEYS)


def _scrub_secrets(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    for key in list(event_dict):
        if _is_secret_key(key):
            event_dict[key] = "**redacted**"
    return event_dict


def _shared() -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]


class _CurrentStderr:
    """Whatever `sys.stderr` is when a line is written, not when logging was configured: a caller that swaps
    stderr (a test runner capturing output, then closing its capture) must not leave loggers writing to a
    closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(service: str, level: str = "INFO", stream: Any = None) -> None:
    out = stream or _CurrentStderr()
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                *_shared(),
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(),
                _scrub_secrets,
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    logging.basicConfig(handlers=[handler], level=level, force=True)
    structlog.configure(
        processors=[
            *_shared(),
            _scrub_secrets,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


bound_context = structlog.contextvars.bound_contextvars
