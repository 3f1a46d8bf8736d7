"""How every read prints: `-o table|wide|json|yaml`, AGE columns, and `--watch`.

json and yaml print the same document (the object as its API or query answers it: one shape per object, whatever
the command that shows it); table and wide are for people (wide adds columns). A watched json read prints one
compact document per line (each time the answer changes), so a script can read it line by line."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from enum import Enum
from typing import Annotated, Any, Optional, Union

import typer

FORMATS = ("table", "wide", "json", "yaml")


def choices(name: str, values: Sequence[str]) -> type[Enum]:
    """A str Enum of `values` for typer, which offers them in --help and completion and refuses others (exit 2);
    a member compares equal to its string."""
    return Enum(name, [(v, v) for v in values], type=str)  # type: ignore[return-value]


Format = choices("Format", FORMATS)
OutputOpt = Annotated[
    Format,  # type: ignore[valid-type]
    typer.Option("--output", "-o", help="table (default), wide (more columns), json or yaml (every field)."),
]
WatchOpt = Annotated[
    bool,
    typer.Option("--watch", "-w", help="Ask again every --interval seconds and print each change, until Ctrl-C."),
]
IntervalOpt = Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between asks with --watch.")]

# A column: a key of the row, or (HEADER, how to get the cell from the row).
Column = Union[str, tuple[str, Callable[[dict[str, Any]], Any]]]


def age(value: Any, now: Optional[datetime] = None) -> str:
    """kubectl's AGE: the largest whole unit of the time since `value` (an ISO time or a datetime)."""
    if value in (None, ""):
        return "-"
    at = value if isinstance(value, datetime) else datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - at).total_seconds()))
    for unit, size, below in (("s", 1, 120), ("m", 60, 120 * 60), ("h", 3600, 48 * 3600)):
        if seconds < below:
            return f"{seconds // size}{unit}"
    return f"{seconds // 86400}d"


def age_of(key: str) -> tuple[str, Callable[[dict[str, Any]], Any]]:
    return ("AGE", lambda row: age(row.get(key)))


def _header(column: Column) -> str:
    return column[0] if isinstance(column, tuple) else column.upper().replace("_", "-")


def _cell(column: Column, row: dict[str, Any]) -> str:
    value = column[1](row) if isinstance(column, tuple) else row.get(column)
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "-"
    return str(value).replace("\n", " ")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """Left-aligned columns two spaces apart, as kubectl prints them."""
    grid = [[_header(c) for c in columns]] + [[_cell(c, r) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in grid)


def fields_text(doc: dict[str, Any], fields: Sequence[Column]) -> str:
    """One `NAME  value` line per field (`show` of one object)."""
    pairs = [(_header(f).lower().replace("-", " ").replace("_", " "), _cell(f, doc)) for f in fields]
    width = max((len(k) for k, _ in pairs), default=0) + 2
    return "\n".join(f"{k.ljust(width)}{v}" for k, v in pairs)


def render(
    doc: Any,
    output: Any,
    *,
    rows: Optional[Sequence[dict[str, Any]]] = None,
    columns: Sequence[Column] = (),
    wide: Sequence[Column] = (),
    fields: Sequence[Column] = (),
    compact: bool = False,
) -> str:
    output = getattr(output, "value", output)
    if output == "json":
        return (
            json.dumps(doc, default=str, separators=(",", ":")) if compact else json.dumps(doc, indent=2, default=str)
        )
    if output == "yaml":
        import yaml

        return yaml.safe_dump(json.loads(json.dumps(doc, default=str)), sort_keys=False).rstrip("\n")
    extra = list(wide) if output == "wide" else []
    if rows is not None:
        return table(rows, [*columns, *extra])
    return fields_text(doc, [*fields, *extra])


def emit(doc: Any, output: str, **how: Any) -> None:
    text = render(doc, output, **how)
    if text:
        typer.echo(text)


def watch(
    fetch: Callable[[], Any],
    show: Callable[[Any, bool], str],
    interval: float,
    *,
    key: Callable[[Any], Any] = lambda doc: doc,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Print `show(fetch(), compact=True)` now and again each time the answer changes, until Ctrl-C (exit 0).

    Compared on the answer, not the text: an AGE column ticking over is no change. A failed ask ends the watch
    with that ask's exit code, as a single ask would."""
    last: Optional[str] = None
    try:
        while True:
            doc = fetch()
            seen = json.dumps(key(doc), default=str, sort_keys=True)
            if seen != last:
                typer.echo(show(doc, True))
                last = seen
            sleep(interval)
    except KeyboardInterrupt:
        return
