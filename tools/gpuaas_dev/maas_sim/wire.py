"""Request decoding and response encoding in MAAS's wire format."""

from __future__ import annotations

import email.parser
import email.policy
import json
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web

from .errors import BadRequest, MaasSimError

JSON_UTF8 = "application/json"


class Params:
    """Request parameters with MAAS semantics: repeated keys are lists, the last value wins for scalars."""

    def __init__(self, pairs: list[tuple[str, str]] | None = None) -> None:
        self._values: dict[str, list[str]] = {}
        # Undecoded bytes of each multipart part (a boot resource's `content` is binary) and the
        # raw body of an octet-stream request (a chunk PUT to an upload_uri).
        self.files: dict[str, bytes] = {}
        self.body: bytes | None = None
        for key, value in pairs or ():
            self.add(key, value)

    def add(self, key: str, value: str) -> None:
        self._values.setdefault(key, []).append(value)

    def extend(self, other: Params) -> None:
        for key, values in other._values.items():
            for value in values:
                self.add(key, value)
        self.files.update(other.files)

    def get(self, key: str, default: str | None = None) -> str | None:
        values = self._values.get(key)
        return values[-1] if values else default

    def getall(self, key: str) -> list[str]:
        # A comma-separated single value is how the MAAS CLI passes some lists (e.g. tags=a,b).
        values = self._values.get(key, [])
        if key not in _COMMA_LISTS:
            return list(values)
        return [item for value in values for item in value.split(",") if item]

    def flag(self, key: str) -> bool:
        value = self.get(key)
        return value is not None and value.strip().lower() in ("1", "true", "yes", "on")

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def keys(self) -> list[str]:
        return list(self._values)


_COMMA_LISTS = frozenset({"tags", "not_tags"})


def _decode_multipart(body: bytes, content_type: str) -> Params:
    # The email parser honours each part's Content-Transfer-Encoding (python-libmaas always sends
    # base64 parts), which aiohttp's multipart reader no longer decodes for us.
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise BadRequest("Bad Request: malformed multipart body.")
    params = Params()
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        payload = part.get_payload(decode=True) or b""
        params.add(str(name), payload.decode("utf-8", errors="replace"))
        params.files[str(name)] = payload
    return params


async def read_params(request: web.Request) -> Params:
    params = Params(list(request.query.items()))
    if request.method in ("POST", "PUT") and request.can_read_body:
        body = await request.read()
        ctype = request.headers.get("Content-Type", "")
        if request.content_type == "multipart/form-data":
            params.extend(_decode_multipart(body, ctype))
        elif request.content_type == "application/x-www-form-urlencoded":
            charset = request.charset or "utf-8"
            params.extend(Params(parse_qsl(body.decode(charset), keep_blank_values=True)))
        else:
            params.body = body
    return params


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data).encode("utf-8"), status=status, content_type=JSON_UTF8, charset="utf-8")


def error_response(error: MaasSimError) -> web.Response:
    response = web.Response(body=error.render(), status=error.status, headers=error.headers)
    response.content_type = error.content_type
    response.charset = "utf-8"
    return response


def text_response(
    text: str, status: int, headers: dict[str, str] | None = None, content_type: str = "text/plain"
) -> web.Response:
    response = web.Response(body=text.encode("utf-8"), status=status, headers=headers or {})
    response.content_type = content_type
    response.charset = "utf-8"
    return response
