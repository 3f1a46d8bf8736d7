"""Ops-view's readings for /metrics (`gpuaas_common.metrics`): the dead-letter stream's size per consumer and how
many letters it ever took (from the stream info its identity may read: it follows DLQ), the dead letters of its
model by reason, and its followers' lag (their consumer info, the same families as every service's durables)."""

from __future__ import annotations

from typing import Any

from gpuaas_common.metrics import Family, Reading, Sample

DLQ_STREAM = "DLQ"
DLQ_PREFIX = "gpuaas.dlq."

DLQ_MESSAGES = Family(
    "gpuaas_dlq_messages", "Dead letters the DLQ stream holds, by the consumer that gave up on them", ("consumer",)
)
DLQ_TOTAL = Family("gpuaas_dlq_stream_messages", "Dead letters the DLQ stream holds, all consumers together")
DLQ_WRITTEN = Family(
    "gpuaas_dlq_dead_letters",
    "Dead letters ever written to the DLQ stream (its last sequence; kept when old letters age out)",
    counter=True,
)
DEAD_LETTERS = Family(
    "gpuaas_ops_view_dead_letters",
    "Dead letters in ops-view's model by consumer and reason",
    ("consumer", "reason_code"),
)


def dlq_reading(js: Any) -> Reading:
    async def read() -> list[Sample]:
        info = await js.stream_info(DLQ_STREAM, subjects_filter=f"{DLQ_PREFIX}>")
        subjects = info.state.subjects or {}
        out = [DLQ_MESSAGES(s.removeprefix(DLQ_PREFIX), value=n) for s, n in sorted(subjects.items())]
        # The total too, so a rule on the DLQ's size has a sample while the stream is empty.
        out.append(DLQ_TOTAL(value=info.state.messages or 0))
        out.append(DLQ_WRITTEN(value=info.state.last_seq or 0))
        return out

    return read


def dead_letters_reading(pool: Any) -> Reading:
    async def read() -> list[Sample]:
        rows = await pool.fetch(
            "SELECT consumer, reason_code, count(*) AS n FROM dead_letters GROUP BY consumer, reason_code "
            "ORDER BY consumer, reason_code"
        )
        return [DEAD_LETTERS(r["consumer"], r["reason_code"], value=r["n"]) for r in rows]

    return read
