"""A wire message into an envelope and its payload, or the PermanentError that sends it to the DLQ.

Part of the bus (`gpuaas_common.bus` re-exports the public names): a consumer decodes each body once, at
receipt (`decode_body`), and validates it against the contract when its turn comes (`parse_message`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from .contract import BY_TYPE, Envelope


class PermanentError(Exception):
    """The message can never succeed: dead-letter it at once instead of retrying."""

    def __init__(self, reason_code: str, reason: str) -> None:
        super().__init__(reason)
        self.reason_code = reason_code
        self.reason = reason


# `parse_message` without a decoded body decodes it itself.
_NOT_DECODED: Any = object()


def decode_body(body: bytes) -> Any:
    """The body as JSON, or the PermanentError saying why it is not. A consumer decodes each body once, at
    receipt: its lane key and its handler's payload both read the result."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return PermanentError("not_json", f"body is not JSON: {exc}")
    # Valid JSON can still carry a NUL or a lone surrogate: Postgres stores neither (a text cannot hold NUL,
    # UTF-8 has no surrogates), so every attempt to record it would fail the same way until max_deliver. A NUL
    # can only come escaped (json.loads refuses raw control characters), a surrogate escaped or as the UTF-8
    # shape of one (json.loads decodes bytes with surrogatepass); a body holding neither shape, the common
    # one, costs two substring searches (0.2 us on a 0.5 kB body; the regex alone took 3.7 us) and no walk.
    if (
        (b"\\u" in body or b"\xed" in body)
        and _UNSTORABLE_SHAPE.search(body)
        and (where := _unstorable(data, "")) is not None
    ):
        return PermanentError("schema_invalid", f"{where} holds a NUL or a lone surrogate, which Postgres cannot store")
    return data


# `\u0000`, `\uD800`-`\uDFFF`, or the bytes ED A0-BF of an encoded surrogate. Escaped backslashes and paired
# surrogates match too: the walk settles them.
_UNSTORABLE_SHAPE = re.compile(rb"\\u(?:0000|[dD][89abcdefABCDEF])|\xed[\xa0-\xbf]")


def _unstorable(value: Any, where: str) -> str | None:
    """The path of the first string (or key) in `value` that Postgres cannot store, or None."""
    if isinstance(value, str):
        return (where or "<root>") if _UNSTORABLE_CHAR.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _unstorable(key, f"{where}.<key>") or _unstorable(item, f"{where}.{key}")
            if found is not None:
                return found.lstrip(".")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _unstorable(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


# A pair of escaped surrogates decodes to one character outside the BMP; only unpaired ones remain here.
_UNSTORABLE_CHAR = re.compile("[\x00\ud800-\udfff]")


def parse_message(subject: str, body: bytes, decoded: Any = _NOT_DECODED) -> tuple[Envelope, BaseModel]:
    """Decode and validate a wire message (`decoded`: what `decode_body` made of `body` already); raises
    PermanentError with a reason code."""
    data = decode_body(body) if decoded is _NOT_DECODED else decoded
    if isinstance(data, PermanentError):
        raise data
    try:
        envelope = Envelope.model_validate(data)
    except ValidationError as exc:
        raise PermanentError("schema_invalid", f"envelope: {_errors(exc)}") from None
    spec = BY_TYPE.get(envelope.type)
    if spec is None:
        raise PermanentError("unknown_type", f"unknown message type {envelope.type!r}")
    if not spec.subject_regex().match(subject):
        raise PermanentError("schema_invalid", f"type {envelope.type} does not travel on {subject}")
    try:
        payload = spec.model.model_validate(envelope.payload)
    except ValidationError as exc:
        raise PermanentError("schema_invalid", f"{envelope.type} payload: {_errors(exc)}") from None
    _check_subject_names_payload(spec, subject, payload)
    return envelope, payload


def _check_subject_names_payload(spec: Any, subject: str, payload: BaseModel) -> None:
    """Defence in depth: the server lets a host publish only on its own subjects, so the subject is
    the authenticated part; a payload that names another node is forged or broken either way."""
    if "node_id" not in spec.parameters:
        return
    claimed = getattr(payload, "node_id", None)
    if claimed is None:
        return
    match = _node_subject(spec.address).fullmatch(subject)
    if match and match.group("node_id") != str(claimed):
        raise PermanentError(
            "subject_mismatch", f"{spec.type} on {subject} names node {claimed!r}, not {match.group('node_id')!r}"
        )


@functools.lru_cache(maxsize=None)
def _node_subject(address: str) -> re.Pattern[str]:
    """The address as a pattern that captures `{node_id}` (compiled once per message type: hot path)."""
    pattern = re.escape(address).replace(re.escape("{node_id}"), r"(?P<node_id>[A-Za-z0-9_-]+)")
    return re.compile(re.sub(r"\\\{[a-z_]+\\\}", "[A-Za-z0-9_-]+", pattern))


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()[:8])
