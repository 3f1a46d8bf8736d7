"""`gpuaas dlq list|show` against a real JetStream holding dead letters in the DLQ stream: the newest first, with the
reason, the original subject and type and an age; one letter with the message it could not process; and the bad
inputs of the exit-code table (a sequence that is not one, one with no letter, no stack, a bus that is not there).

Every letter published here is a contract-valid `dead_letter` envelope, and what `show -o json` gives back is
checked to be the same letter."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpuaas_common.contract import Envelope, spec_for
from gpuaas_common.contract import messages as m
from gpuaas_common.contract.asyncapi import default_validator
from gpuaas_dev.cli import app


@pytest.fixture(autouse=True)
def no_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    for var in ("GPUAAS_CONTEXT", "GPUAAS_RUN_DIR", "GPUAAS_NATS_URL", "GPUAAS_NATS_CREDS", "GPUAAS_NATS_CA_FILE"):
        monkeypatch.delenv(var, raising=False)


async def gpuaas(*argv: str) -> Any:
    return await asyncio.to_thread(CliRunner().invoke, app, list(argv))


async def dead_letter(js: Any, consumer: str, reason_code: str, original: bytes) -> int:
    try:
        body_text, body_b64 = original.decode(), None
    except UnicodeDecodeError:
        body_text, body_b64 = None, base64.b64encode(original).decode()
    payload = m.DeadLetter(consumer=consumer, stream="NODE_REPORTS", subject="gpuaas.node.n1.report.task_result",
                           stream_seq=77, num_delivered=5, reason_code=reason_code, reason=f"{reason_code} happened",
                           body_text=body_text, body_base64=body_b64)  # fmt: skip
    env = Envelope.wrap("dead_letter", payload.model_dump(mode="json"), producer="allocator", correlation_id="c")
    subject = spec_for("dead_letter").subject(consumer=consumer)
    data = env.model_dump_json().encode()
    default_validator().validate(subject, data)
    ack = await js.publish(subject, data, headers={"Nats-Msg-Id": env.event_id})
    return ack.seq


async def test_list_shows_the_newest_letters_of_a_consumer_with_reason_subject_type_and_age(js, nats_server) -> None:
    consumer = f"allocator-task-results-{uuid.uuid4().hex[:8]}"
    result = json.dumps({"type": "node.task_result", "payload": {"task_id": "t-1"}}).encode()
    seqs = [
        await dead_letter(js, consumer, "schema_invalid", result),
        await dead_letter(js, consumer, "not_json", b"\xff\xfenot json"),
        await dead_letter(js, consumer, "max_deliver", result),
    ]
    await dead_letter(js, f"other-{uuid.uuid4().hex[:8]}", "handler_error", result)

    res = await gpuaas(
        "dlq", "list", "--consumer", consumer, "--limit", "2", "-o", "json", "--nats-url", nats_server.url
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["dead_letters"]
    assert [(r["seq"], r["reason_code"], r["type"]) for r in rows] == [
        (seqs[2], "max_deliver", "node.task_result"),
        (seqs[1], "not_json", None),
    ]
    assert {r["subject"] for r in rows} == {"gpuaas.node.n1.report.task_result"}

    table = await gpuaas("dlq", "list", "--consumer", consumer, "--nats-url", nats_server.url)
    assert table.exit_code == 0, table.output
    header, *lines = table.stdout.splitlines()
    assert header.split() == ["SEQ", "AGE", "CONSUMER", "REASON", "SUBJECT", "TYPE"]
    assert [line.split()[0] for line in lines] == [str(s) for s in reversed(seqs)]
    assert lines[0].split()[1].endswith("s") and lines[0].split()[3] == "max_deliver"

    everyone = await gpuaas("dlq", "list", "--limit", "1", "-o", "json", "--nats-url", nats_server.url)
    assert [r["consumer"] for r in json.loads(everyone.stdout)["dead_letters"]] != [consumer], "newest of all first"


async def test_show_gives_the_letter_and_the_message_it_could_not_process(js, nats_server) -> None:
    consumer = f"scheduler-node-parity-{uuid.uuid4().hex[:8]}"
    original = {"type": "node.parity_reported", "payload": {"node_id": "n1", "checks": []}}
    seq = await dead_letter(js, consumer, "schema_invalid", json.dumps(original).encode())
    stored = await js.get_msg("DLQ", seq)

    res = await gpuaas("dlq", "show", str(seq), "-o", "json", "--nats-url", nats_server.url)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    envelope = default_validator().validate(stored.subject, stored.data)
    assert doc["event_id"] == envelope["event_id"] and doc["consumer"] == consumer
    assert (doc["reason_code"], doc["reason"], doc["num_delivered"]) == ("schema_invalid", "schema_invalid happened", 5)
    assert doc["original"] == original

    human = await gpuaas("dlq", "show", str(seq), "--nats-url", nats_server.url)
    assert human.exit_code == 0, human.output
    text = human.stdout
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in text.split("message:\n", 1)[0].splitlines())
    assert (fields["reason code"], fields["consumer"], fields["origin"]) == (
        "schema_invalid",
        consumer,
        "NODE_REPORTS:77",
    )
    assert text.split("message:\n", 1)[1].strip() == json.dumps(original, indent=2)

    binary = await dead_letter(js, consumer, "not_json", b"\xff\x00\x01")
    shown = json.loads((await gpuaas("dlq", "show", str(binary), "-o", "json", "--nats-url", nats_server.url)).stdout)
    assert shown["original"] == {"base64": base64.b64encode(b"\xff\x00\x01").decode(), "bytes": 3}


def one_line(res: Any) -> str:
    assert res.stdout == "" and "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


async def test_bad_inputs_end_with_the_tables_code_and_one_line(js, nats_server, tmp_path: Path) -> None:
    info = await js.stream_info("DLQ")
    beyond = info.state.last_seq + 1000

    for seq in ("x", "0", "1.5", "١"):
        res = await gpuaas("dlq", "show", seq, "--nats-url", nats_server.url)
        assert (res.exit_code, one_line(res)) == (2, f"invalid dead letter id {seq!r}: not a stream sequence number")
    res = await gpuaas("dlq", "list", "--consumer", "a.b", "--nats-url", nats_server.url)
    assert res.exit_code == 2 and one_line(res).startswith("invalid consumer 'a.b'")

    missing = await gpuaas("dlq", "show", str(beyond), "--nats-url", nats_server.url)
    assert (missing.exit_code, one_line(missing)) == (1, f"no dead letter {beyond}")

    for argv in (["dlq", "list"], ["dlq", "show", "1"]):
        res = await gpuaas(*argv)
        assert res.exit_code == 3
        assert one_line(res).startswith(f"no NATS URL: no stack runs in {tmp_path / '.run' / 'dev'}; ")

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        down = await gpuaas(*argv, "--nats-url", f"nats://127.0.0.1:{port}")
        assert down.exit_code == 3
        assert one_line(down).startswith(f"cannot connect to NATS at nats://127.0.0.1:{port}")


async def test_an_empty_or_purged_dlq_lists_nothing_and_exits_0(tmp_path: Path) -> None:
    """A new stack's DLQ stream is empty (first and last sequence 0) and a purged one has first = last + 1: no
    sequence there may be asked for. The table says so on stderr; json and yaml give an empty list."""
    import nats

    from gpuaas_common.jetstream import provision
    from gpuaas_dev.testing.servers import NatsServer

    server = NatsServer(tmp_path / "nats").start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await provision(js)
        for stage in ("new", "purged"):
            if stage == "purged":
                await dead_letter(js, "allocator-task-results", "max_deliver", b"{}")
                await js.purge_stream("DLQ")
            info = await js.stream_info("DLQ")
            assert info.state.messages == 0 and (info.state.first_seq, info.state.last_seq) == (
                (0, 0) if stage == "new" else (2, 1)
            )
            table = await gpuaas("dlq", "list", "--nats-url", server.url)
            assert (table.exit_code, table.stdout) == (0, ""), table.output
            assert table.stderr.strip() == "no dead letters in the DLQ stream"
            consumer = "allocator-task-results"
            of = await gpuaas("dlq", "list", "--consumer", consumer, "--nats-url", server.url)
            assert of.exit_code == 0 and of.stderr.strip() == f"no dead letters of {consumer} in the DLQ stream"
            as_json = await gpuaas("dlq", "list", "-o", "json", "--nats-url", server.url)
            assert as_json.exit_code == 0 and json.loads(as_json.stdout) == {"dead_letters": []}
            shown = await gpuaas("dlq", "show", "1", "--nats-url", server.url)
            assert (shown.exit_code, one_line(shown)) == (1, "no dead letter 1")
        await nc.drain()
    finally:
        server.stop()
