"""A test's NATS client acting as one identity: its creds, TLS first against the test's CA, its own inbox prefix
(`_INBOX_<name>`, what every identity's permissions allow), no reconnect (a refusal shows at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nats
from nats.aio.client import RawCredentials

from gpuaas_common.identity import Creds
from gpuaas_common.identity.tls import client_tls_options


async def connect_as(url: str, ca_file: Path | str, creds: Creds, **kw: Any) -> nats.NATS:
    kw.setdefault("inbox_prefix", f"_INBOX_{creds.name}".encode())
    return await nats.connect(
        url,
        user_credentials=RawCredentials(creds.render()),
        **client_tls_options(ca_file),
        allow_reconnect=False,
        connect_timeout=5,
        **kw,
    )
