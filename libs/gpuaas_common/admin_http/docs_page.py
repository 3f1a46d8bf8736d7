"""The browsable page of an admin API's OpenAPI document (`GET /docs`): rendered on the server from the same
document `/openapi.json` serves, one self-contained HTML page with no script and nothing fetched from elsewhere,
so it works on an operator network with no way out."""

from __future__ import annotations

from html import escape
from typing import Any

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:72em;padding:0 1em;color:#1b1f24}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:.35em .6em;border-bottom:1px solid #d8dee4;
vertical-align:top}th{background:#f3f5f7}code{font:13px ui-monospace,monospace}.m{font-weight:600}
.GET{color:#0a6b2d}.POST{color:#7a4b00}.PUT,.PATCH{color:#1f4fa0}.DELETE{color:#a01f1f}.e{color:#57606a}
"""


def _schema_name(content: Any) -> str:
    """The component name a request or response body refers to ("" when it has none)."""
    ref = (((content or {}).get("application/json") or {}).get("schema") or {}).get("$ref", "")
    return ref.rsplit("/", 1)[-1]


def _row(method: str, path: str, op: dict[str, Any]) -> str:
    body = _schema_name((op.get("requestBody") or {}).get("content"))
    ok, errors = [], []
    for status, answer in op.get("responses", {}).items():
        name = _schema_name(answer.get("content"))
        (ok if status.startswith("2") else errors).append(f"{status} {name}".strip())
    needs_key = any(p.get("$ref", "").endswith("/IdempotencyKey") for p in op.get("parameters", []))
    cells = [
        f'<td class="m {escape(method.upper())}">{escape(method.upper())}</td>',
        f"<td><code>{escape(path)}</code></td>",
        f"<td>{escape(op.get('summary', ''))}{' <span class=e>(Idempotency-Key)</span>' if needs_key else ''}</td>",
        f"<td><code>{escape(body) or '-'}</code></td>",
        f"<td><code>{escape(', '.join(ok))}</code></td>",
        f"<td class=e><code>{escape(', '.join(errors))}</code></td>",
    ]
    return f"<tr>{''.join(cells)}</tr>"


def render_docs_page(doc: dict[str, Any]) -> str:
    info = doc.get("info", {})
    rows = [
        _row(method, path, op)
        for path, ops in doc.get("paths", {}).items()
        for method, op in ops.items()
        if isinstance(op, dict)
    ]
    title = escape(str(info.get("title", "admin API")))
    return (
        "<!doctype html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{_STYLE}</style></head><body>\n'
        f"<h1>{title} <small class=e>v{escape(str(info.get('version', '')))}</small></h1>\n"
        f"<p>{escape(str(info.get('description', '')))}</p>\n"
        "<p>Every route wants <code>Authorization: Bearer &lt;token&gt;</code>; every error is "
        "<code>{&quot;error&quot;: {code, message, details, request_id}}</code>. The document itself: "
        '<a href="openapi.json">openapi.json</a>, <a href="openapi.yaml">openapi.yaml</a>.</p>\n'
        "<table><thead><tr><th>method</th><th>path</th><th>summary</th><th>request</th><th>response</th>"
        "<th>errors</th></tr></thead><tbody>\n" + "\n".join(rows) + "\n</tbody></table>\n</body></html>\n"
    )
