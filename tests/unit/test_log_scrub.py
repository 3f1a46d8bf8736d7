"""The log scrub hides secret values wherever they sit in a line, not only under secret key names, and leaves
what is not secret readable."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from gpuaas_common.identity.creds import Creds
from gpuaas_common.identity.jwt import Key, encode
from gpuaas_common.logging import configure_logging, get_logger

ACCOUNT = Key.generate("account")
USER = Key.generate("user")
USER_JWT = encode(ACCOUNT, USER.public, "node-slice-01", {"type": "user"})
CREDS = Creds(jwt=USER_JWT, seed=USER.seed).render()
DB_PASSWORD = "p@ss:w0rd-Zq9"
DSN = f"postgresql://gpuaas_allocator:{DB_PASSWORD}@127.0.0.1:5432,127.0.0.2:5432/gpuaas"
SEED = USER.seed.decode()
SECRETS = [SEED, ACCOUNT.seed.decode(), USER_JWT, USER_JWT.split(".")[1], USER_JWT.split(".")[2], DB_PASSWORD, "p@ss"]


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    configure_logging("scrub-test", "DEBUG", stream=stream)
    try:
        yield stream
    finally:
        configure_logging("tests", "INFO")


def _logged(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def _assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


def test_secret_values_under_ordinary_keys_and_in_the_event_are_redacted(lines) -> None:
    log = get_logger("scrub")
    public = USER.public  # an identity, not a secret: logged to say who was issued or revoked
    words = "SUCCESS SELECT SAVEPOINT " + "A" * 70
    log.info(
        f"connecting with {SEED}",
        detail=CREDS,
        url=DSN,
        header=f"Bearer {USER_JWT}",
        nested={"x": [SEED]},
        user=public,
        note=words,
        plain_url="postgresql://gpuaas@127.0.0.1/gpuaas",
        nats="tls://[::1]:4222",
    )
    text = lines.getvalue()
    _assert_no_secret(text)
    (line,) = _logged(lines)
    assert line["event"] == "connecting with **redacted**"
    assert line["nested"] == {"x": ["**redacted**"]}
    assert line["header"] == "Bearer **redacted**"
    # What identifies without being secret stays: the user and hosts of the URL, the line's other words.
    assert line["url"] == "postgresql://gpuaas_allocator:**redacted**@127.0.0.1:5432,127.0.0.2:5432/gpuaas"
    # Each creds block goes whole, markers included; the text between them stays.
    assert line["detail"].count("**redacted**") == 2 and "IMPORTANT" in line["detail"]
    # Nor does what only looks like a secret go: a public key, upper-case words, a URL without a password.
    assert line["user"] == public and line["note"] == words
    assert line["plain_url"] == "postgresql://gpuaas@127.0.0.1/gpuaas" and line["nats"] == "tls://[::1]:4222"


def test_an_exception_and_a_stdlib_record_are_scrubbed_too(lines) -> None:
    log = get_logger("scrub")
    try:
        raise ConnectionError(f"could not connect to {DSN} as {USER_JWT}")
    except ConnectionError:
        log.exception("connect_failed")
    logging.getLogger("nats.aio.client").warning("nkey seed %s refused", SEED)
    text = lines.getvalue()
    _assert_no_secret(text)
    first, second = _logged(lines)
    assert "ConnectionError" in first["exception"]
    assert second["event"] == "nkey seed **redacted** refused"


def test_a_truncated_creds_block_is_redacted_to_the_end_of_its_string(lines) -> None:
    # A reason cut at a length limit loses the END line; what follows the BEGIN line is still secret.
    get_logger("scrub").warning("bad_creds", reason=CREDS[:200], after="kept")
    _assert_no_secret(lines.getvalue())
    (line,) = _logged(lines)
    assert line["reason"] == "**redacted**" and line["after"] == "kept"
