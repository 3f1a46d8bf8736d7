"""A dead letter fits what a host may publish (64 KiB), whatever the message it carries: a letter over the limit
made the server drop the host's connection, and with it every task waiting behind the bad message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpuaas_common.bus_dispatch import LETTER_BUDGET, _fitting_letter
from gpuaas_common.jetstream import node_agent_consumer

HOST_MAX_PAYLOAD = 64 * 1024
CASES = {
    "small text kept whole": b'{"type": "slice.vm_provision", "payload": {}}',
    "big text": b"x" * 200_000,
    "text that JSON escapes sixfold": b"\x01" * 60_000,
    "binary": bytes(range(256)) * 400,
}


@pytest.mark.parametrize("body", list(CASES.values()), ids=list(CASES))
def test_a_letter_fits_a_hosts_payload_limit_and_says_when_its_body_was_cut(body: bytes) -> None:
    raw = SimpleNamespace(
        data=body, subject="gpuaas.node.n1.tasks.slice.vm_provision", headers={"Nats-Msg-Id": "m" * 5000}
    )
    letter = _fitting_letter(node_agent_consumer("n1"), raw, "not_json", "body is not JSON", 1, 7)
    size = len(letter.model_dump_json())
    assert size <= LETTER_BUDGET < HOST_MAX_PAYLOAD
    kept = (letter.body_text or "").encode() if letter.body_text is not None else None
    if len(body) < 1000:
        assert kept == body and "cut" not in letter.reason
    else:
        assert "cut to its first" in letter.reason
        assert kept is None or body.startswith(kept)
