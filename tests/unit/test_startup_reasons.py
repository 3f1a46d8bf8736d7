"""What a start-up failure is called and how the process exits: the rules the subprocess tests rely on."""

from __future__ import annotations

import errno

import pytest
from pydantic import ValidationError

from gpuaas_common.settings import ServiceSettings
from gpuaas_common.startup import EXIT_CODES, StartupFailed, classify, redact, settings_errors


def test_every_reason_has_its_own_non_zero_exit_code() -> None:
    codes = list(EXIT_CODES.values())
    assert len(set(codes)) == len(codes) and all(0 < c < 126 for c in codes)


def test_an_unknown_reason_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown start-up failure reason"):
        StartupFailed("database_sad", "x")


def test_settings_errors_name_the_variable_and_never_the_value() -> None:
    with pytest.raises(ValidationError) as caught:
        ServiceSettings(health_port=-7, log_level="loud-secret-value")
    errors = settings_errors(caught.value)
    assert {e["setting"] for e in errors} == {"GPUAAS_HEALTH_PORT", "GPUAAS_LOG_LEVEL"}
    assert "loud-secret-value" not in repr(errors) and "-7" not in repr(errors)
    failure = classify(caught.value)
    assert (failure.reason, failure.exit_code) == ("invalid_settings", 78)


def test_a_taken_port_and_an_unclassified_failure() -> None:
    assert classify(OSError(errno.EADDRINUSE, "Address already in use")).reason == "port_unavailable"
    try:
        raise KeyError("nobody expected this")
    except KeyError as exc:
        failure = classify(exc)
    assert (failure.reason, failure.exit_code) == ("startup_error", 70)
    # A bug keeps its traceback, inside the one line.
    assert "Traceback" in failure.log_fields()["exception"] and "nobody expected this" in failure.detail


def test_redact_removes_every_given_secret() -> None:
    assert redact("password pw1 for postgresql://u:pw1@h/db", "pw1", None) == (
        "password **redacted** for postgresql://u:**redacted**@h/db"
    )
