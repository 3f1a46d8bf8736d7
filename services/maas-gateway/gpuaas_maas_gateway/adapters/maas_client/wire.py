"""Wire helpers: the API root from a configured URL, Retry-After parsing and MAAS form encoding."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse


def api_root(url: str) -> str:
    """Accept `http://host:5240/MAAS/` or the full `…/MAAS/api/2.0/`, like the MAAS CLI does."""
    parsed = urlparse(url)
    path = parsed.path if parsed.path.endswith("/") else parsed.path + "/"
    if not path.rstrip("/").endswith("/api/2.0"):
        path += "api/2.0/"
    return parsed._replace(path=path, query="", fragment="").geturl()


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _pairs(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Flatten to MAAS form pairs: lists repeat the key, booleans are true/false, None is omitted."""
    out: list[tuple[str, str]] = []
    for key, value in data.items():
        values = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
        for item in values:
            if item is None:
                continue
            if isinstance(item, bool):
                item = "true" if item else "false"
            out.append((key, str(item)))
    return out
