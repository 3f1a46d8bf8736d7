"""No default enrolment secret: the allocator and the MAAS gateway, started without one (or with an empty or short
one, as `${GPUAAS_ENROLMENT_SECRET:-}` gives without .env), refuse at once with one `invalid_settings` line that
names the variable and never its value. The real console scripts, started as processes; nothing else runs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from pydantic import ValidationError

from gpuaas_allocator.settings import AllocatorSettings
from gpuaas_common.startup import EXIT_CODES, classify
from gpuaas_dev.stack.processes import bin_path
from gpuaas_maas_gateway.settings import GatewaySettings

SERVICES = {"gpuaas-allocator": AllocatorSettings, "gpuaas-maas-gateway": GatewaySettings}
SHORT = "guessable-123"  # 13 characters


def _start(script: str, secret: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
    env |= {"PYTHONUNBUFFERED": "1", "GPUAAS_HEALTH_PORT": "0", "GPUAAS_NATS_INSECURE_DEV": "true"}
    if secret is not None:
        env["GPUAAS_ENROLMENT_SECRET"] = secret
    return subprocess.run(
        [bin_path(script)], env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize("script", sorted(SERVICES))
@pytest.mark.parametrize("secret", [None, "", SHORT], ids=["unset", "empty", "short"])
def test_a_service_without_a_usable_enrolment_secret_refuses_to_start(script: str, secret: str | None) -> None:
    done = _start(script, secret)
    out = done.stdout + done.stderr
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    (line,) = lines
    assert (line["event"], line["reason"], done.returncode) == (
        "startup_failed",
        "invalid_settings",
        EXIT_CODES["invalid_settings"],
    ), out
    assert [e["setting"] for e in line["errors"]] == ["GPUAAS_ENROLMENT_SECRET"], out
    assert line["detail"].startswith("GPUAAS_ENROLMENT_SECRET: ")
    assert "Traceback" not in out and (not secret or secret not in out)


@pytest.mark.parametrize("settings_cls", list(SERVICES.values()), ids=list(SERVICES))
def test_the_settings_have_no_default_and_take_a_secret_of_sixteen_characters(settings_cls, monkeypatch) -> None:
    monkeypatch.delenv("GPUAAS_ENROLMENT_SECRET", raising=False)
    assert settings_cls.model_fields["enrolment_secret"].is_required()
    with pytest.raises(ValidationError) as missing:
        settings_cls()
    assert classify(missing.value).fields["errors"] == [
        {"setting": "GPUAAS_ENROLMENT_SECRET", "error": "Field required"}
    ]
    with pytest.raises(ValidationError):
        settings_cls(enrolment_secret="x" * 15)
    assert settings_cls(enrolment_secret="x" * 16).enrolment_secret.get_secret_value() == "x" * 16
    monkeypatch.setenv("GPUAAS_ENROLMENT_SECRET", "from-the-environment")
    assert settings_cls().enrolment_secret.get_secret_value() == "from-the-environment"
