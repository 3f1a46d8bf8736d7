"""docker-compose.yml stays in step with the code: commands exist, env vars are settings fields, NATS
keeps JetStream on disk."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

ROOT = Path(__file__).resolve().parents[2]

# Console script -> the settings class its service reads.
SETTINGS_BY_SCRIPT = {
    "gpuaas-allocator": "gpuaas_allocator.settings.AllocatorSettings",
    "gpuaas-scheduler": "gpuaas_scheduler.settings.SchedulerSettings",
    "gpuaas-image-pipeline": "gpuaas_image_pipeline.settings.ImagePipelineSettings",
    "gpuaas-maas-gateway": "gpuaas_maas_gateway.settings.GatewaySettings",
    "gpuaas-node-agent": "gpuaas_node_agent.settings.AgentSettings",
}
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)[^}]*\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command")
    return cmd.split() if isinstance(cmd, str) else list(cmd or [])


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    # ${VAR:?msg} / ${VAR:-default} resolve to a placeholder: only the names matter here.
    return {k: _INTERPOLATION.sub(lambda m: f"x-{m.group(1).lower()}", str(v)) for k, v in env.items()}


def _gpuaas_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if _command(svc)[:1] and
            _command(svc)[0].startswith("gpuaas")}


def _resolve_cli(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Parse `gpuaas <args>` with the real typer app, as the container would (its env included).

    Typer carries its own copy of click, so groups and errors are recognised by behaviour, not class.
    """
    from gpuaas_dev.cli import app

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cmd = typer.main.get_command(app)
    ctx = typer.Context(cmd, info_name="gpuaas")
    rest = list(args)
    while hasattr(cmd, "list_commands"):
        assert rest, f"`gpuaas {' '.join(args)}` stops at a command group"
        sub = cmd.get_command(ctx, rest[0])
        assert sub is not None, f"`gpuaas` knows no subcommand {rest[0]!r} (in {args})"
        ctx = typer.Context(sub, info_name=rest[0], parent=ctx)
        cmd, rest = sub, rest[1:]
    # A full parse checks option names, types and required options. Paths with `exists=True` point
    # into a container volume, so that one error is tolerated, and only that one.
    try:
        cmd.make_context(ctx.info_name, list(rest), parent=ctx.parent)
    except typer.BadParameter as exc:
        if "does not exist" not in exc.format_message():
            raise AssertionError(f"`gpuaas {' '.join(args)}`: {exc.format_message()}") from None
    except typer.BadParameter.__mro__[1] as exc:  # UsageError: unknown option, missing value
        raise AssertionError(f"`gpuaas {' '.join(args)}`: {exc.format_message()}") from None
    return cmd


def test_every_command_is_a_declared_console_script(compose, scripts, monkeypatch):
    services = _gpuaas_services(compose)
    assert {_command(s)[0] for s in services.values()} >= set(SETTINGS_BY_SCRIPT), "a service is missing"
    for name, svc in services.items():
        cmd = _command(svc)
        assert cmd[0] in scripts, f"{name}: {cmd[0]} is not a console script of pyproject.toml"
        if cmd[0] == "gpuaas":
            assert scripts["gpuaas"] == "gpuaas_dev.cli:main"
            _resolve_cli(cmd[1:], _env(svc), monkeypatch)
        else:
            assert len(cmd) == 1, f"{name}: services take their configuration from GPUAAS_* env, not args"


def test_every_service_env_var_is_a_settings_field(compose):
    checked = 0
    for name, svc in _gpuaas_services(compose).items():
        script = _command(svc)[0]
        if script not in SETTINGS_BY_SCRIPT:
            continue
        module, _, cls_name = SETTINGS_BY_SCRIPT[script].rpartition(".")
        settings_cls = getattr(importlib.import_module(module), cls_name)
        env = _env(svc)
        fields = set(settings_cls.model_fields)
        for key in env:
            assert key.startswith("GPUAAS_"), f"{name}: {key} is not a GPUAAS_* variable"
            assert key.removeprefix("GPUAAS_").lower() in fields, (
                f"{name}: {key} is not a field of {settings_cls.__name__} (fields: {sorted(fields)})"
            )
            checked += 1
        # And the values are acceptable to the settings class, the way the container will read them.
        settings_cls.model_validate({k.removeprefix("GPUAAS_").lower(): v for k, v in env.items()})
    assert checked > 0


def test_cli_services_env_vars_are_declared_by_their_command(compose, monkeypatch):
    for name, svc in _gpuaas_services(compose).items():
        cmd = _command(svc)
        if cmd[0] != "gpuaas":
            continue
        command = _resolve_cli(cmd[1:], _env(svc), monkeypatch)
        envvars = {p.envvar for p in command.params if isinstance(getattr(p, "envvar", None), str)}
        for key in _env(svc):
            assert key in envvars, f"{name}: `gpuaas {cmd[1]}` reads no {key}"


def test_nats_runs_jetstream_on_file_storage_in_a_volume(compose):
    nats = next(s for s in compose["services"].values() if str(s.get("image", "")).startswith("nats:"))
    assert str(nats["image"]).startswith("nats:2.10")
    cmd = _command(nats)
    assert "-js" in cmd or "--jetstream" in cmd
    flag = "-sd" if "-sd" in cmd else "--store_dir"
    assert flag in cmd, "JetStream needs a store dir for file storage"
    store = cmd[cmd.index(flag) + 1]
    mounts = [str(v).split(":")[1] for v in nats.get("volumes", [])]
    assert store in mounts, f"the store dir {store} is not a volume, JetStream data would die with the container"
    assert "healthcheck" in nats


def test_services_wait_for_healthy_dependencies(compose):
    for name, svc in _gpuaas_services(compose).items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions, not a list"
        env = _env(svc)
        if "GPUAAS_NATS_URL" in env:
            assert deps.get("nats", {}).get("condition") == "service_healthy", name
        if "GPUAAS_DATABASE_URL" in env and _command(svc)[0] != "gpuaas-node-agent":
            assert deps.get("postgres", {}).get("condition") == "service_healthy", name
        if _command(svc)[0] in SETTINGS_BY_SCRIPT:
            assert "healthcheck" in svc, f"{name}: no healthcheck"


def test_each_database_service_connects_as_its_own_role_made_by_the_init_step(compose):
    from gpuaas_common.pg_roles import SERVICE_ROLES

    services = _gpuaas_services(compose)
    init = [name for name, svc in services.items() if _command(svc)[1:3] == ["dev", "pg-roles"]]
    assert len(init) == 1, "exactly one `gpuaas dev pg-roles` init step"
    init_env = services[init[0]].get("environment") or {}
    assert services[init[0]]["depends_on"]["postgres"]["condition"] == "service_healthy"
    seen: dict[str, str] = {}
    for name, svc in services.items():
        service = _command(svc)[0].removeprefix("gpuaas-")
        dsn = (svc.get("environment") or {}).get("GPUAAS_DATABASE_URL")
        if service not in SERVICE_ROLES:
            assert dsn is None, f"{name} has no database role, so it must not get a DSN"
            continue
        assert dsn, f"{name}: no GPUAAS_DATABASE_URL"
        var = f"GPUAAS_PG_{service.upper().replace('-', '_')}_PASSWORD"
        # `:-`, not `:?`: `docker compose down` must work without the secrets; the init step refuses empties.
        assert dsn.startswith(f"postgresql://{SERVICE_ROLES[service].role}:${{{var}:-}}@postgres:"), (name, dsn)
        assert init_env.get(var) == f"${{{var}:-}}", f"the init step does not set {var} for {name}'s role"
        assert svc["depends_on"][init[0]]["condition"] == "service_completed_successfully", name
        seen[name] = SERVICE_ROLES[service].role
    assert set(seen.values()) == {s.role for s in SERVICE_ROLES.values()}, "a role-owning service is missing"
    assert len(set(seen.values())) == len(seen), "two services share a role"
    assert all(":?" not in str(v) for v in init_env.values())
