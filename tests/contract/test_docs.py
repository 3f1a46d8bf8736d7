"""The README's configuration and CLI tables are made from the code (gpuaas_dev.docs) and say what parses."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import BaseModel, ValidationError

from gpuaas_dev import docs


def _classes() -> list[type[BaseModel]]:
    return [entry.load() for entry in docs.SETTINGS]


def test_readme_generated_sections_are_what_the_code_says():
    current = docs.README.read_text()
    assert docs.render(current) == current, (
        "README.md drifted from the settings classes or the CLI: run `.venv/bin/python -m gpuaas_dev.docs`"
    )


def test_every_settings_class_of_a_process_is_documented_and_every_field_has_a_meaning():
    documented = {entry.path for entry in docs.SETTINGS}
    assert set(docs.SETTINGS_BY_SCRIPT.values()) <= documented
    for cls in _classes():
        comments = docs.field_comments(cls)
        for name in cls.__dict__.get("__annotations__", {}):
            if name in cls.model_fields:
                field = cls.model_fields[name]
                assert field.description or comments.get(name), f"{cls.__name__}.{name}: no comment above it"
    # Every variable of every process appears, exactly once per class that declares it.
    rows = list(docs.settings_rows())
    for script, path in docs.SETTINGS_BY_SCRIPT.items():
        cls = next(c for e, c in zip(docs.SETTINGS, _classes(), strict=True) if e.path == path)
        names = {row[0].strip("`") for row in rows}
        missing = {f"GPUAAS_{f.upper()}" for f in cls.model_fields} - names
        assert not missing, f"{script}: {sorted(missing)} not in the table"


def test_cli_section_quotes_each_commands_help():
    section = docs.cli_section()
    commands = list(docs.cli_commands())
    assert len(commands) >= 20
    for path, cmd, _ in commands:
        help_text = docs._help(cmd)
        assert help_text, f"{' '.join(path)} has no help text"
        (row,) = [
            line
            for line in section.splitlines()
            if line.startswith(f"| `{' '.join(path)} ") or line.startswith(f"| `{' '.join(path)}`")
        ]
        assert row.endswith(f"| {docs._cell(help_text)} |"), row
        for param in cmd.params:
            if docs._is_option(param) and not param.hidden:
                assert max(param.opts, key=len) in row, f"{' '.join(path)}: {param.opts} missing"


def _list_fields() -> list[tuple[type[BaseModel], str, typing.Any]]:
    found = []
    for cls in _classes():
        for name, field in cls.model_fields.items():
            if docs._is_list(field.annotation) and (cls, name) not in [(c, n) for c, n, _ in found]:
                found.append((cls, name, typing.get_args(field.annotation)[0]))
    return found


SAMPLES = {float: ["0.2", "0.5", "1"], str: ["focal", "noble"], int: ["1", "2"]}
# List fields whose items have a shape of their own.
FIELD_SAMPLES = {
    "emulated_slot_disks": ["/dev/disk/by-id/nvme-lab-slot0", "/dev/disk/by-id/nvme-lab-slot1"],
    "host_path_map": ["/var/lib/gpuaas/images=/srv/lab/images", "/var/lib/gpuaas/seeds=/srv/lab/seeds"],
}
REQUIRED = {
    "GPUAAS_FLEET_FILE": "fleet.json",
    "GPUAAS_KEYS_DIR": "keys",
    "GPUAAS_API_TLS_CERT_FILE": "authority.pem",
    "GPUAAS_API_TLS_KEY_FILE": "authority-key.pem",
}


@pytest.mark.parametrize("form", ["comma", "comma-spaced", "json"])
def test_list_settings_take_comma_separated_values_or_json_from_the_environment(form, monkeypatch):
    """What the README's format line promises, for every list field of every settings class."""
    fields = _list_fields()
    assert {name for _, name, _ in fields} >= {"retry_delays_s", "maas_stock_series", "maas_uploaded_images"}
    for key, value in REQUIRED.items():
        monkeypatch.setenv(key, value)
    for cls, name, item in fields:
        raw = FIELD_SAMPLES.get(name, SAMPLES[item])
        text = {
            "comma": ",".join(raw),
            "comma-spaced": " , ".join(raw),
            "json": json.dumps([item(v) for v in raw]),
        }[form]
        monkeypatch.setenv(f"GPUAAS_{name.upper()}", text)
        assert getattr(cls(), name) == tuple(item(v) for v in raw), (cls.__name__, name, text)
        monkeypatch.delenv(f"GPUAAS_{name.upper()}")


def test_list_settings_refuse_bad_values_with_a_validation_error_naming_the_field(monkeypatch):
    from gpuaas_common.settings import ServiceSettings
    from gpuaas_maas_gateway.settings import GatewaySettings

    for bad in ("[0.2,", "0.2,fast", ""):  # broken JSON, not a number, and no delay at all
        monkeypatch.setenv("GPUAAS_RETRY_DELAYS_S", bad)
        with pytest.raises(ValidationError) as exc:
            ServiceSettings()
        assert exc.value.errors()[0]["loc"][0] == "retry_delays_s", bad
    monkeypatch.delenv("GPUAAS_RETRY_DELAYS_S")
    # An empty list is a value of its own where the field allows it.
    monkeypatch.setenv("GPUAAS_MAAS_UPLOADED_IMAGES", "")
    assert GatewaySettings().maas_uploaded_images == ()


def test_json_object_settings_take_json(monkeypatch):
    from gpuaas_maas_gateway.settings import GatewaySettings

    monkeypatch.setenv("GPUAAS_MAAS_SITES", '{"lab": {"url": "http://maas:5240/MAAS/", "api_key": "a:b:c"}}')
    monkeypatch.setenv("GPUAAS_SITE_PROFILES", '{"p": {"distro_series": "jammy", "tags": ["h200"]}}')
    settings = GatewaySettings()
    assert settings.maas_sites["lab"].url == "http://maas:5240/MAAS/"
    assert settings.site_profiles["p"].tags == ("h200",)
