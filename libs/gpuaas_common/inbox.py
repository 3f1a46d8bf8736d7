"""Idempotent consumer: remember (consumer, message_id) in the same transaction as the effects.

A host-fed consumer's rows also name the node whose message they remember (`HostInbox`), and each (consumer,
node) keeps only its newest `keep` rows, trimmed by the claim that adds one: a host decides how many messages it
sends, so without the cap one host could grow the table by a row a message for the whole retention (8 days).
What the cap gives up: a redelivery or republish of a host's message older than that host's newest `keep`
messages to the consumer finds no row and is handled again, as if the host had sent it once more (which it may
do anyway, within its budget). Copies come back within minutes (redelivery; JetStream's 15-minute duplicate
window), so in practice only a host that sent `keep` messages to one consumer in that time meets it; a durable
re-created to replay its stream (7 days) meets it for any host past its newest `keep`. What a repeat does:
- allocator task results are judged by the allocation's state, not the inbox: an answer the allocation no longer
  awaits matches no rule and changes nothing; one to a task it gave up on adds another `late_task_result` note
  to its timeline; an early result already kept is not kept twice;
- allocator enrolments: a repeat of one taken returns; a refused one adds a note (at most
  HOST_NOTES_PER_ALLOCATION per allocation);
- scheduler reports carry their host's clock and one older than the last applied is stale; wipe proofs are
  judged by the task they answer;
- image-pipeline enrolments re-prove the host's caches (prewarm tasks again); a cache report sets the host's
  cache row to what it says until the host's next report.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from .db import text_literal


@dataclass(frozen=True)
class HostInbox:
    """Where a host-fed message's inbox row goes: the group of the node it came from (its subject's, the node
    its budget keys on), of which the newest `keep` rows are kept."""

    node_id: str
    keep: int

    def __post_init__(self) -> None:
        if not self.node_id or self.keep < 1:
            raise ValueError(f"a host's inbox group needs a node id and keeps at least one row ({self!r})")


def claim_statement(consumer: str, message_id: str, host: HostInbox | None = None) -> str:
    """The claim as SQL text, so a unit of work can send it with its BEGIN in one round trip; its status
    is `INSERT 0 1` the first time and `INSERT 0 0` for a redelivery or a republish.

    With `host` the row takes its place in its group from `inbox_node_seq` (migration 000_inbox_node), which first
    trims the group: a new message deletes the row `keep` places below its own, so the group holds at most `keep`
    once it is in; a repeat deletes nothing. The function waits for the group's turn (an advisory lock of the
    two-key form, which no aggregate lock uses, held to the commit), so each place is unique and counts the group
    exactly; each of its statements is one probe of `inbox_node`, planned once a connection, whatever the cap.
    The turns cost a host's concurrent messages at one consumer their overlap; no host-fed consumer names a first
    lock (`Bus.subscribe`), so a claim waiting its turn holds no lock. A lowered cap applies to the rows that come
    after it; the rows already above it go with the age sweep."""
    c, mid = text_literal(consumer), text_literal(message_id)
    if host is None:
        return f"INSERT INTO inbox (consumer, message_id) VALUES ({c}, {mid}) ON CONFLICT DO NOTHING"
    n = text_literal(host.node_id)
    return (
        f"INSERT INTO inbox (consumer, message_id, node_id, node_seq) "
        f"VALUES ({c}, {mid}, {n}, inbox_node_seq({c}, {mid}, {n}, {int(host.keep)})) ON CONFLICT DO NOTHING"
    )


def claimed(status: str) -> bool:
    return status == "INSERT 0 1"


async def claim(conn: asyncpg.Connection, consumer: str, message_id: str, host: HostInbox | None = None) -> bool:
    """True the first time this consumer sees the message; False for a redelivery or a republish."""
    return claimed(await conn.execute(claim_statement(consumer, message_id, host)))
