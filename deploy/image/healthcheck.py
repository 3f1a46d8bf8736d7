"""The image's HEALTHCHECK: GET /readyz of the process's health server, with the standard library alone.

Docker's contract: exit 0 healthy, 1 unhealthy (one line on stdout says why; `docker inspect` shows it). The
address is the process's own settings: GPUAAS_HEALTH_PORT (the image sets 8080; 0 is a port the OS picks, which
no probe can know) and GPUAAS_HEALTH_HOST (a wildcard address is probed on loopback).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

_WILDCARD = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def probe_url(env: dict[str, str]) -> str:
    port = env.get("GPUAAS_HEALTH_PORT", "8080").strip()
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"GPUAAS_HEALTH_PORT={port!r}: the probe needs the fixed port the health server listens on")
    host = env.get("GPUAAS_HEALTH_HOST", "127.0.0.1").strip()
    host = _WILDCARD.get(host, host)
    return f"http://[{host}]:{port}/readyz" if ":" in host else f"http://{host}:{port}/readyz"


def main() -> int:
    try:
        url = probe_url(dict(os.environ))
        with urllib.request.urlopen(url, timeout=3) as resp:
            print(f"{url}: {resp.status}")
            return 0
    except urllib.error.HTTPError as exc:  # 503: up, not ready (its body names the failing checks)
        print(f"{exc.url}: {exc.code} {exc.read(500).decode(errors='replace')}")
    except (ValueError, OSError) as exc:
        print(f"unhealthy: {exc}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
