"""Revocations go on while the account's JetStream is re-applied after an account JWT update."""

import nats.js.errors
import pytest
from nats.js.errors import KeyWrongLastSequenceError

from gpuaas_common.identity.authority import _through_account_updates


async def test_a_moment_without_responders_is_waited_out() -> None:
    calls = []

    async def kv_get() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise nats.js.errors.ServiceUnavailableError  # what nats-py raises on "no responders"
        return "entry"

    assert await _through_account_updates(kv_get) == "entry"
    assert len(calls) == 3


async def test_a_lost_compare_and_set_is_the_callers_to_handle_not_retried_here() -> None:
    calls = []

    async def kv_update() -> None:
        calls.append(1)
        raise KeyWrongLastSequenceError

    with pytest.raises(KeyWrongLastSequenceError):
        await _through_account_updates(kv_update)
    assert len(calls) == 1
