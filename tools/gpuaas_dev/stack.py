"""The embedded development stack: real NATS and Postgres, the MAAS simulator and the five services as
separate processes, with a simulated fleet behind them.

Synchronous on purpose: tests, the benchmark and the CLI drive it with plain calls, from inside an event
loop or not. The one async step (creating the database) runs on a private thread.

    stack = Stack(Path(".run/dev"))
    stack.start()            # returns once every service answers /readyz
    stack.kill("allocator")  # SIGKILL by PID
    stack.restart("allocator")
    stack.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuaas_common.fleet import Fleet, generate_fleet
from gpuaas_common.identity import Authority
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS, node_user_name
from gpuaas_common.identity.permissions import SERVICES as BUS_SERVICES
from gpuaas_common.identity.tls import TlsFiles, make_ca_and_server_cert
from gpuaas_common.pg_roles import SERVICE_ROLES, dsn_without_password, ensure_service_roles
from gpuaas_dev.testing.servers import NatsServer, PostgresServer, RegistryServer, free_port

from .maas_sim.auth import generate_api_key
from .seed_images import build_seed

MAAS_SIM = "maas-sim"
# Start order; stop runs in reverse so consumers go before what they consume from.
SERVICES: tuple[str, ...] = ("image-pipeline", "allocator", "scheduler", "maas-gateway", "node-agent")
ALL_PROCESSES: tuple[str, ...] = (MAAS_SIM, *SERVICES)
DATABASE = "gpuaas"
FLEET_SUBNET = "127.100.0.0/16"

# Stack timer names -> `gpuaas maas-sim` flags.
_TIMER_FLAGS = {
    "deploying": "--deploy-seconds",
    "releasing": "--release-seconds",
    "disk_erasing": "--erase-seconds",
    "commissioning": "--commission-seconds",
    "testing": "--testing-seconds",
}


class StackError(RuntimeError):
    """A process of the stack failed to start or become ready; the message names it and quotes its log."""


def bin_path(name: str) -> str:
    """A console script of this installation: beside the interpreter first, so a venv wins over PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise StackError(f"{name} not found; run `make setup` (pip install -e .)")
    return found


def tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def maas_machines(fleet: Fleet) -> list[dict[str, Any]]:
    """The simulator's machine list: exactly the fleet's baremetal nodes, so their system ids agree."""
    return [
        {"system_id": n.maas_system_id, "hostname": n.hostname, "tags": ["gpuaas", n.sku]}
        for n in fleet.nodes
        if n.kind == "baremetal" and n.maas_system_id
    ]


def prepare_fleet_dir(
    out_dir: Path,
    *,
    slice_hosts: int = 4,
    slots_per_host: int = 8,
    baremetal_hosts: int = 2,
    ssh_port: int = 2222,
    hosts_root: Path | None = None,
) -> dict[str, Path]:
    """Write what the stack's processes read at start: fleet, MAAS machine list, seed images.

    Shared by `Stack` and `gpuaas dev fleet` (the compose file's init step), so both run the same fleet.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    fleet = generate_fleet(
        slice_hosts=slice_hosts,
        slots_per_host=slots_per_host,
        baremetal_hosts=baremetal_hosts,
        root_dir=hosts_root or out_dir / "hosts",
        subnet=FLEET_SUBNET,
        ssh_port=ssh_port,
    )
    fleet_file = out_dir / "fleet.json"
    fleet.dump(fleet_file)
    machines_file = out_dir / "maas-machines.json"
    machines_file.write_text(json.dumps(maas_machines(fleet), indent=2))
    images_dir = out_dir / "images"
    seed_file = build_seed(images_dir)
    return {"fleet": fleet_file, "machines": machines_file, "images": images_dir, "seed": seed_file}


def _run_coro(factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    # A thread of its own: the caller may already be inside a running loop (pytest-asyncio, bench).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, factory()).result()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class _Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ready_file: Path
    ready_path: str  # HTTP path answering 200 when ready
    proc: subprocess.Popen | None = None
    port: int | None = None  # health port (services) or API port (maas-sim)
    started_at: float | None = None
    restarts: int = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Stack:
    def __init__(
        self,
        run_dir: Path | str,
        *,
        slice_hosts: int = 4,
        slots_per_host: int = 8,
        baremetal_hosts: int = 2,
        maas_timers: Mapping[str, float] | None = None,
        env_overrides: Mapping[str, Any] | None = None,
        ready_timeout_s: float = 90.0,
        stop_timeout_s: float = 15.0,
        log_level: str = "INFO",
        auth: bool = True,
    ) -> None:
        """`env_overrides` maps GPUAAS_* names to values for every service; a key that is a process
        name (e.g. "maas-gateway") maps to a dict applied to that process only.

        `auth` (default) runs NATS in operator mode with TLS and every process as its own identity;
        `auth=False` is an open bus, only for measuring what the identities cost."""
        self.run_dir = Path(run_dir).resolve()
        self.slice_hosts = slice_hosts
        self.slots_per_host = slots_per_host
        self.baremetal_hosts = baremetal_hosts
        unknown = set(maas_timers or {}) - set(_TIMER_FLAGS)
        if unknown:
            raise ValueError(f"unknown MAAS timers {sorted(unknown)}; known: {sorted(_TIMER_FLAGS)}")
        self.maas_timers = dict(maas_timers or {})
        self.env_overrides = dict(env_overrides or {})
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_level = log_level
        self.auth = auth
        self.status = "new"
        self._authority: Authority | None = None
        self._tls: TlsFiles | None = None
        self._nats: NatsServer | None = None
        self._pg: PostgresServer | None = None
        self._registry: RegistryServer | None = None
        self._admin_token: str | None = None
        self._admin_port: int | None = None
        self._dsn: str | None = None
        self._service_dsns: dict[str, str] = {}  # service -> its own role's DSN, password inside
        self._fleet: Fleet | None = None
        self._maas_api_key: str | None = None
        self._enrolment_secret: str | None = None
        self._procs: dict[str, _Proc] = {}
        self._files: dict[str, Path] = {}

    # --- public properties --------------------------------------------------------------------------

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def description_file(self) -> Path:
        return self.run_dir / "stack.json"

    @property
    def nats_url(self) -> str:
        if self._nats is None:
            raise StackError("stack not started")
        return self._nats.url

    @property
    def creds_dir(self) -> Path:
        return self.run_dir / "creds"

    @property
    def ca_file(self) -> Path | None:
        return self._tls.ca if self._tls else None

    def creds_path(self, identity: str) -> Path | None:
        """`<run-dir>/creds/<identity>.creds`: a role (`portal`, `ops`, `admin`, a service) or `node-<id>`."""
        if not self.auth:
            return None
        path = self.creds_dir / f"{identity}.creds"
        if not path.exists():
            raise StackError(f"no credentials for {identity!r} in {self.creds_dir}")
        return path

    def nats_options(self, identity: str = "admin") -> dict[str, Any]:
        """nats.connect() keyword arguments for a test or benchmark client acting as `identity`."""
        from gpuaas_common.natsconn import NatsIdentity, split_servers

        creds = self.creds_path(identity)
        ident = NatsIdentity(
            split_servers(self.nats_url), str(creds) if creds else None, str(self.ca_file) if self.ca_file else None
        )
        return ident.connect_kwargs()

    @property
    def authority(self) -> Authority:
        if self._authority is None:
            raise StackError("stack not started with auth")
        return self._authority

    @property
    def dsn(self) -> str:
        if self._dsn is None:
            raise StackError("stack not started")
        return self._dsn

    def service_dsn(self, service: str) -> str:
        """The DSN `service` runs with: its own role, which owns its schema and may touch nothing else.

        `dsn` is the superuser's, for tests and benchmarks that inspect every schema.
        """
        if service not in SERVICE_ROLES:
            raise StackError(f"{service!r} has no database role; those that do: {', '.join(SERVICE_ROLES)}")
        if service not in self._service_dsns:
            raise StackError("stack not started")
        return self._service_dsns[service]

    @property
    def maas_url(self) -> str:
        return f"{self.maas_base_url}/MAAS/"

    @property
    def maas_base_url(self) -> str:
        sim = self._procs.get(MAAS_SIM)
        if sim is None or sim.port is None:
            raise StackError("MAAS simulator not started")
        return f"http://127.0.0.1:{sim.port}"

    @property
    def maas_api_key(self) -> str:
        if self._maas_api_key is None:
            raise StackError("stack not started")
        return self._maas_api_key

    @property
    def enrolment_secret(self) -> str:
        if self._enrolment_secret is None:
            raise StackError("stack not started")
        return self._enrolment_secret

    @property
    def registry_host(self) -> str:
        if self._registry is None:
            raise StackError("stack not started")
        return self._registry.host

    @property
    def host_image_dir(self) -> Path:
        """Where the image pipeline writes MAAS host image tgz files for the gateway to upload."""
        return self.run_dir / "host-images"

    @property
    def image_admin_url(self) -> str:
        return f"http://127.0.0.1:{self._admin_port}"

    @property
    def image_admin_token(self) -> str:
        if self._admin_token is None:
            raise StackError("stack not started")
        return self._admin_token

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise StackError("stack not started")
        return self._fleet

    @property
    def services(self) -> tuple[str, ...]:
        return ALL_PROCESSES

    def pid(self, service: str) -> int | None:
        return self._get(service).pid

    def is_running(self, service: str) -> bool:
        return self._get(service).alive()

    def health_url(self, service: str) -> str:
        p = self._get(service)
        if p.port is None:
            raise StackError(f"{service} has no known port yet")
        return f"http://127.0.0.1:{p.port}"

    def log_path(self, service: str) -> Path:
        return self._get(service).log_path

    def log_tail(self, service: str, lines: int = 40) -> str:
        return tail(self.log_path(service), lines)

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> "Stack":
        if self.status in ("starting", "ready"):
            raise StackError("stack already started")
        self.status = "starting"
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.status = "ready"
        self.describe()
        return self

    def _start(self) -> None:
        self._reset_run_dir()
        self._maas_api_key = str(generate_api_key())
        self._enrolment_secret = secrets.token_hex(32)
        self._admin_token = secrets.token_hex(24)
        self._admin_port = free_port()
        self._write_secrets()

        # Held before start() so a start that fails half-way is still stopped by stop().
        if self.auth:
            self._make_identities()
        self._nats = NatsServer(self.run_dir / "nats", auth=self._authority, tls=self._tls)
        self._nats.start()
        self._pg = PostgresServer(self.run_dir / "pg")
        self._pg.start()
        self._dsn = _run_coro(lambda: _create_database(self._pg.dsn, DATABASE))  # type: ignore[union-attr]
        self._create_service_roles()
        self._registry = RegistryServer(self.run_dir / "registry")
        self._registry.start()

        files = prepare_fleet_dir(
            self.run_dir / "fleet",
            slice_hosts=self.slice_hosts,
            slots_per_host=self.slots_per_host,
            baremetal_hosts=self.baremetal_hosts,
            ssh_port=free_port(),
            hosts_root=self.run_dir / "hosts",
        )
        self._fleet = Fleet.load(files["fleet"])
        self._files = files
        self._provision_bus()
        self.describe()

        # The simulator picks its own port; the gateway and the agents need it, so it goes first.
        self._procs[MAAS_SIM] = self._maas_sim_proc(port=0)
        self._spawn(self._procs[MAAS_SIM])
        self._wait([MAAS_SIM], self.ready_timeout_s)
        for name in SERVICES:
            self._procs[name] = self._service_proc(name)
            self._spawn(self._procs[name])
        self.describe()
        self._wait(list(SERVICES), self.ready_timeout_s)

    def stop(self) -> None:
        """SIGTERM every process this stack started (by PID), SIGKILL after `stop_timeout_s`."""
        running = [p for name in reversed(ALL_PROCESSES) if (p := self._procs.get(name)) and p.alive()]
        for p in running:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for p in running:
            assert p.proc is not None
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.proc.wait()
        if self._nats is not None:
            self._nats.stop()
            self._nats = None
        if self._registry is not None:
            self._registry.stop()
            self._registry = None
        if self._pg is not None:
            try:
                self._pg.stop()
            except (AttributeError, OSError, subprocess.SubprocessError):
                pass  # it never got as far as running
            finally:
                self._pg = None
        if self.status != "new":
            self.status = "stopped"
            self.describe()

    def kill(self, service: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the service's process; for SIGKILL/SIGTERM, return once it has exited."""
        p = self._get(service)
        if not p.alive():
            return
        self._signal(p, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            assert p.proc is not None
            try:
                p.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.proc.wait()
        self.describe()

    def restart(self, service: str) -> None:
        """Stop the service if it runs, start it with the same environment, wait until ready."""
        p = self._get(service)
        if p.alive():
            self.kill(service, signal.SIGTERM)
        if service == MAAS_SIM:
            # Same port again: the gateway and the agents were given this URL.
            p.argv = self._maas_sim_argv(p.port or 0)
        p.restarts += 1
        self._spawn(p)
        self.describe()
        self.wait_ready(service)

    def wait_ready(self, service: str, timeout_s: float | None = None) -> None:
        self._wait([service], timeout_s or self.ready_timeout_s)
        self.describe()

    def crashed(self) -> list[str]:
        """Processes that were started and have exited without being asked to."""
        return [name for name, p in self._procs.items() if p.proc is not None and p.proc.poll() is not None]

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> dict[str, Any]:
        """What a developer or the CLI needs to reach the stack; written to `run_dir/stack.json`.

        Never contains the MAAS API key or the enrolment secret (those live in `secrets.json`, mode 0600).
        """
        procs = {}
        for name, p in self._procs.items():
            entry: dict[str, Any] = {
                "pid": p.pid if p.alive() else None,
                "running": p.alive(),
                "log": str(p.log_path),
                "restarts": p.restarts,
            }
            if name == MAAS_SIM:
                entry["port"] = p.port
            else:
                entry["health_port"] = p.port
                entry["readyz"] = f"http://127.0.0.1:{p.port}/readyz" if p.port else None
            procs[name] = entry
        info = {
            "status": self.status,
            "run_dir": str(self.run_dir),
            "supervisor_pid": os.getpid(),
            "nats_url": self._nats.url if self._nats else None,
            "nats_ca_file": str(self._tls.ca) if self._tls else None,
            "creds_dir": str(self.creds_dir) if self.auth else None,
            "nats_pid": self._nats.proc.pid if self._nats and self._nats.proc else None,
            "database_url": dsn_without_password(self._dsn) if self._dsn else None,
            "maas_url": self.maas_url if self._procs.get(MAAS_SIM) and self._procs[MAAS_SIM].port else None,
            "fleet_file": str(self.run_dir / "fleet" / "fleet.json"),
            "registry_url": self._registry.url if self._registry else None,
            "image_admin_url": f"http://127.0.0.1:{self._admin_port}" if self._admin_port else None,
            "fleet": {
                "slice_hosts": self.slice_hosts,
                "slots_per_host": self.slots_per_host,
                "baremetal_hosts": self.baremetal_hosts,
            },
            "services": procs,
            "secrets_file": str(self.run_dir / "secrets.json"),
            "updated_at": time.time(),
        }
        if self.run_dir.exists():
            tmp = self.description_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(info, indent=2))
            tmp.replace(self.description_file)
        return info

    # --- internals ----------------------------------------------------------------------------------

    def _get(self, service: str) -> _Proc:
        try:
            return self._procs[service]
        except KeyError:
            raise StackError(f"unknown or not started service {service!r}; known: {', '.join(ALL_PROCESSES)}") from None

    def _reset_run_dir(self) -> None:
        # Every start is a fresh world: NATS state left from an earlier run would not match a new database.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("nats", "pg", "hosts", "fleet", "ready", "registry", "image-builds", "keys", "creds", "tls"):
            shutil.rmtree(self.run_dir / sub, ignore_errors=True)
        (self.run_dir / "ready").mkdir()
        self.logs_dir.mkdir(exist_ok=True)
        for old in self.logs_dir.glob("*.log"):
            if old.name != "supervisor.log":
                old.unlink()

    def _write_secrets(self) -> None:
        path = self.run_dir / "secrets.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(
                {
                    "maas_api_key": self._maas_api_key,
                    "enrolment_secret": self._enrolment_secret,
                    "image_admin_token": self._admin_token,
                },
                f,
            )
        os.chmod(path, 0o600)

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
        env.update(
            PYTHONUNBUFFERED="1",
            GPUAAS_NATS_URL=self.nats_url,
            GPUAAS_HEALTH_HOST="127.0.0.1",
            GPUAAS_HEALTH_PORT="0",
            GPUAAS_LOG_LEVEL=self.log_level,
        )
        # Keep a developer's opt-outs such as GPUAAS_NO_DOCKER; the stack's own settings win over the rest.
        if "GPUAAS_NO_DOCKER" in os.environ:
            env["GPUAAS_NO_DOCKER"] = os.environ["GPUAAS_NO_DOCKER"]
        return env

    def _apply_overrides(self, name: str, env: dict[str, str]) -> dict[str, str]:
        for key, value in self.env_overrides.items():
            if isinstance(value, Mapping):
                if key == name:
                    env.update({k: str(v) for k, v in value.items()})
            elif key not in ALL_PROCESSES:
                env[key] = str(value)
        return env

    def _maas_sim_argv(self, port: int) -> list[str]:
        argv = [
            bin_path("gpuaas"),
            "maas-sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--machines-file",
            str(self._files["machines"]),
            "--ready-file",
            str(self.run_dir / "ready" / f"{MAAS_SIM}.json"),
        ]
        for timer, seconds in self.maas_timers.items():
            argv += [_TIMER_FLAGS[timer], str(seconds)]
        return argv

    def _maas_sim_proc(self, port: int) -> _Proc:
        env = self._base_env()
        # Through the environment, not argv: argv is world-readable in the process list.
        env["GPUAAS_MAAS_API_KEY"] = self.maas_api_key
        return _Proc(
            name=MAAS_SIM,
            argv=self._maas_sim_argv(port),
            env=self._apply_overrides(MAAS_SIM, env),
            log_path=self.logs_dir / f"{MAAS_SIM}.log",
            ready_file=self.run_dir / "ready" / f"{MAAS_SIM}.json",
            ready_path="/_sim/healthz",
        )

    def _service_proc(self, name: str) -> _Proc:
        env = self._base_env() | self._database_env(name) | self._nats_env(name)
        ready_file = self.run_dir / "ready" / f"{name}.json"
        env["GPUAAS_READY_FILE"] = str(ready_file)
        if name == "allocator":
            env["GPUAAS_ENROLMENT_SECRET"] = self.enrolment_secret
        elif name == "scheduler":
            env["GPUAAS_INVENTORY_FILE"] = str(self._files["fleet"])
        elif name == "image-pipeline":
            env["GPUAAS_IMAGE_SEED_FILE"] = str(self._files["seed"])
            assert self._registry is not None and self._admin_token is not None
            env.update(
                GPUAAS_REGISTRY_HOST=self._registry.host,
                GPUAAS_REGISTRY_TLS_MODE="plain-http",
                GPUAAS_ADMIN_PORT=str(self._admin_port),
                GPUAAS_ADMIN_TOKEN=self._admin_token,
                GPUAAS_IMAGE_BUILD_DIR=str(self.run_dir / "image-builds"),
                # The gateway uploads host images by the path the pipeline names; both run on this
                # machine, so a run-dir directory is shared without any gateway setting.
                GPUAAS_HOST_IMAGE_DIR=str(self.host_image_dir),
            )
        elif name == "maas-gateway":
            env["GPUAAS_MAAS_URL"] = self.maas_url
            env["GPUAAS_MAAS_API_KEY"] = self.maas_api_key
            env["GPUAAS_ENROLMENT_SECRET"] = self.enrolment_secret
        elif name == "node-agent":
            env["GPUAAS_FLEET_FILE"] = str(self._files["fleet"])
            env["GPUAAS_MAAS_SIM_URL"] = self.maas_base_url
            env["GPUAAS_SIM_IMAGE_DIR"] = str(self._files["images"])
            env["GPUAAS_LIBVIRT_URI"] = "test:///default"
        # The node agent's place in the stack is taken by the simulated fleet: every host in one process.
        command = "gpuaas-sim-fleet" if name == "node-agent" else f"gpuaas-{name}"
        return _Proc(
            name=name,
            argv=[bin_path(command)],
            env=self._apply_overrides(name, env),
            log_path=self.logs_dir / f"{name}.log",
            ready_file=ready_file,
            ready_path="/readyz",
        )

    def _spawn(self, p: _Proc) -> None:
        p.ready_file.unlink(missing_ok=True)
        if p.name != MAAS_SIM:
            p.port = None  # a restarted service binds a new health port; don't advertise the old one
        with p.log_path.open("ab") as log:
            log.write(f"--- gpuaas dev: starting {p.name} at {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
            log.flush()
            # A session of its own: a Ctrl-C in the developer's terminal reaches the supervisor only,
            # which then stops the services in order.
            p.proc = subprocess.Popen(
                p.argv,
                env=p.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                start_new_session=True,
            )
        p.started_at = time.monotonic()

    def _signal(self, p: _Proc, sig: int) -> None:
        if p.proc is not None and p.proc.poll() is None:
            try:
                p.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def _check_ready(self, p: _Proc) -> bool:
        if p.proc is None:
            return False
        try:
            info = json.loads(p.ready_file.read_text())
        except (OSError, ValueError):
            return False
        if info.get("pid") != p.proc.pid:
            return False  # a stale file of an earlier incarnation
        port = info.get("health_port") or info.get("port")
        if not port:
            return False
        p.port = int(port)
        return _http_ok(f"http://127.0.0.1:{p.port}{p.ready_path}")

    def _wait(self, names: list[str], timeout_s: float) -> None:
        pending = {name: self._get(name) for name in names}
        deadline = time.monotonic() + timeout_s
        while pending:
            for name, p in list(pending.items()):
                if p.proc is not None and p.proc.poll() is not None:
                    raise StackError(
                        f"{name} exited with code {p.proc.returncode} before it was ready; "
                        f"last lines of {p.log_path}:\n{tail(p.log_path)}"
                    )
                if self._check_ready(p):
                    del pending[name]
            if not pending:
                return
            if time.monotonic() >= deadline:
                name, p = next(iter(pending.items()))
                raise StackError(
                    f"{', '.join(pending)} not ready after {timeout_s:.0f}s; last lines of {p.log_path}:\n"
                    f"{tail(p.log_path)}"
                )
            time.sleep(0.1)

    # --- bus identities -----------------------------------------------------------------------------

    def _make_identities(self) -> None:
        """A fresh operator, accounts and CA for every start; one creds file per identity (0600)."""
        self._tls = make_ca_and_server_cert(self.run_dir / "tls")
        auth = self._authority = Authority.create()
        for role, perms in ROLE_PERMISSIONS.items():
            creds_files.write(self.creds_dir / f"{role}.creds", auth.issue_user(role, perms))
        keys = self.run_dir / "keys"
        auth.save(keys)
        # What the gateway needs to mint and revoke baremetal hosts' users, and nothing more.
        creds_files.write_secret(keys / "maas-gateway-issuer.json", auth.issuer().dump())

    def _onboard_slice_hosts(self) -> None:
        """What ops do when a slice host joins: its own user and creds file, its task durable."""
        assert self._authority is not None and self._fleet is not None
        for node in self._fleet.nodes:
            if node.kind == "slice_host":
                creds_files.write(
                    self.creds_dir / f"{node_user_name(node.node_id)}.creds", self._authority.issue_host(node.node_id)
                )
        self._authority.save(self.run_dir / "keys")

    def _provision_bus(self) -> None:
        """Streams and every slice host's durable, as the admin identity: no service or host may."""
        assert self._fleet is not None
        if self.auth:
            self._onboard_slice_hosts()
        options = self.nats_options("admin")
        node_ids = [n.node_id for n in self._fleet.nodes if n.kind == "slice_host"]

        async def provision_all() -> None:
            import nats

            from gpuaas_common.jetstream import node_agent_consumer, provision

            nc = await nats.connect(**options, connect_timeout=5, max_reconnect_attempts=3)
            try:
                await provision(nc.jetstream(), [node_agent_consumer(n) for n in node_ids])
            finally:
                await nc.close()

        _run_coro(provision_all)

    def _nats_env(self, name: str) -> dict[str, str]:
        if not self.auth:
            return {}
        assert self._tls is not None
        env = {"GPUAAS_NATS_CA_FILE": str(self._tls.ca)}
        if name in BUS_SERVICES:
            env["GPUAAS_NATS_CREDS"] = str(self.creds_dir / f"{name}.creds")
        if name == "node-agent":
            env["GPUAAS_NATS_CREDS_DIR"] = str(self.creds_dir)
        if name == "maas-gateway":
            env["GPUAAS_NATS_AUTHORITY_FILE"] = str(self.run_dir / "keys" / "maas-gateway-issuer.json")
        return env

    # --- per-service Postgres roles -----------------------------------------------------------------

    def _create_service_roles(self) -> None:
        """One login role per Postgres-backed service (gpuaas_common.pg_roles), fresh passwords each start."""
        assert self._pg is not None
        pg = self._pg
        passwords = {service: secrets.token_hex(24) for service in SERVICE_ROLES}
        self._service_dsns = _run_coro(lambda: ensure_service_roles(pg.dsn, DATABASE, passwords))
        self._record_database_secrets()

    def _database_env(self, name: str) -> dict[str, str]:
        # Only the services with a role get a DSN: the node agent and the simulator need no database.
        return {"GPUAAS_DATABASE_URL": self._service_dsns[name]} if name in self._service_dsns else {}

    def _record_database_secrets(self) -> None:
        # Added to what _write_secrets wrote: database passwords live in this 0600 file, never in stack.json.
        path = self.run_dir / "secrets.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data.update(admin_database_url=self._dsn, service_database_urls=self._service_dsns)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.chmod(path, 0o600)


async def _create_database(admin_dsn: str, name: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(admin_dsn)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    parts = urllib.parse.urlsplit(admin_dsn)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))
