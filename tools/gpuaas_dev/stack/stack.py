"""The `Stack` itself: its settings, what it exposes to tests and the CLI, and its lifecycle."""

from __future__ import annotations

import secrets
import shutil
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuaas_common.fleet import Fleet
from gpuaas_common.identity import Authority
from gpuaas_common.identity import creds as creds_files
from gpuaas_common.identity.permissions import node_user_name
from gpuaas_common.identity.tls import TlsFiles, make_ca_and_server_cert
from gpuaas_common.pg_roles import SERVICE_ROLES
from gpuaas_dev.testing.databases import ServiceDatabases
from gpuaas_dev.testing.servers import NatsCluster, NatsServer, PostgresServer, RegistryServer, free_port

from ..maas_sim.auth import generate_api_key
from .approval import ApprovalFailed, approve_slice_hosts
from .coroutines import run_coro
from .database import create_service_roles, service_admin_dsns
from .description import ADMIN_APIS, PRINCIPAL_SECRETS, describe_stack, record_database_secrets, write_secrets
from .environment import TIMER_FLAGS, maas_sim_argv, maas_sim_proc, service_proc
from .fleet import prepare_fleet_dir
from .identities import make_identities, onboard_slice_hosts, provision_bus, renew_credentials
from .maas_tls import client_ssl, issue_sim_cert, urllib_trusts
from .preflight import commission_slice_hosts
from .processes import (
    ALL_PROCESSES,
    AUTHORITY,
    MAAS_SIM,
    SERVICES,
    StackError,
    _Proc,
    send_signal,
    spawn,
    tail,
    wait_until_ready,
)


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
        unsafe_no_fsync: bool = False,
        nats_cluster: int = 1,
        replicas: int = 1,
        lab: bool = False,
        lab_slots: int = 1,
        lab_baremetal: bool = False,
        pg_tls: bool = False,
        maas_insecure_http: bool = False,
    ) -> None:
        """`env_overrides` maps GPUAAS_* names to values for every service; a key that is a process
        name (e.g. "maas-gateway") maps to a dict applied to that process only.

        `auth` (default) runs NATS in operator mode with TLS and every process as its own identity;
        `auth=False` is an open bus, only for measuring what the identities cost.

        Postgres is durable (fsync, synchronous_commit on); `unsafe_no_fsync=True` is faster and may lose the
        last commits in a crash: only for tests and benchmarks that ask for it.

        `nats_cluster=3` runs three nats-servers in one JetStream cluster with every stream at R3 (clients get
        every seed URL); `replicas=N` runs N processes of each long-running service (allocator, scheduler,
        image pipeline, MAAS gateway) sharing their durables. The simulated fleet stays one process: hosts are
        not replicated, each is one agent.

        `pg_tls` runs Postgres with TLS from a CA of its own (`<run-dir>/pg-tls/ca.pem`), refuses plaintext TCP
        logins, and gives every client DSN `sslmode=verify-full` with that CA.

        The MAAS simulator serves HTTPS with a certificate for 127.0.0.1/localhost from the stack's CA
        (`<run-dir>/tls/ca.pem`, NATS's too); the gateway gets that CA as GPUAAS_MAAS_CA_FILE and every other
        client of the simulator trusts it alone (`maas_ssl_context`). `maas_insecure_http=True`, for a test that
        means it, serves plain HTTP instead and gives the gateway GPUAAS_MAAS_INSECURE_HTTP, which it warns about."""
        if nats_cluster not in (1, 3, 5):
            raise ValueError("nats_cluster must be 1, 3 or 5 (a JetStream cluster needs a majority)")
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.nats_cluster = nats_cluster
        self.replicas = replicas
        # `lab`: a real slice host beside the simulated fleet (stack/lab_host.py): QEMU/TCG in a namespace.
        self.lab = lab
        self.lab_slots = lab_slots
        # `lab_baremetal`: also a MAAS machine that is a VM in the lab (stack/lab_machine.py), deployed with the
        # lab's host image, which the pipeline builds and the gateway uploads at start.
        if lab_baremetal and not lab:
            raise ValueError("lab_baremetal needs lab=True")
        self.lab_baremetal = lab_baremetal
        self._lab_host_image: dict[str, Any] | None = None
        self._lab: Any = None
        self._lab_image: dict[str, Any] | None = None
        self.run_dir = Path(run_dir).resolve()
        self.slice_hosts = slice_hosts
        self.slots_per_host = slots_per_host
        self.baremetal_hosts = baremetal_hosts
        unknown = set(maas_timers or {}) - set(TIMER_FLAGS)
        if unknown:
            raise ValueError(f"unknown MAAS timers {sorted(unknown)}; known: {sorted(TIMER_FLAGS)}")
        self.maas_timers = dict(maas_timers or {})
        self.env_overrides = dict(env_overrides or {})
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_level = log_level
        self.auth = auth
        # The credential authority's HTTPS port (picked at start; 0 until then).
        self.authority_port = 0
        self.unsafe_no_fsync = unsafe_no_fsync
        self.pg_tls = pg_tls
        self.maas_insecure_http = maas_insecure_http
        self.status = "new"
        self._authority: Authority | None = None
        self._tls: TlsFiles | None = None
        self._nats: NatsCluster | None = None
        self._pg: PostgresServer | None = None
        self._registry: RegistryServer | None = None
        # One bearer token per admin API (scheduler, image pipeline); both in secrets.json.
        self._admin_tokens: dict[str, str] = {}
        # The other principals' secrets (billing, the console's token and login key): no two principals share one.
        self._principal_secrets: dict[str, str] = {}
        self._admin_dsn: str | None = None  # the superuser's, on the cluster's maintenance database
        self._service_dsns: dict[str, str] = {}  # service -> its own role's DSN, password inside
        self._fleet: Fleet | None = None
        self._maas_api_key: str | None = None
        self._enrolment_secret: str | None = None
        self._procs: dict[str, _Proc] = {}
        self._files: dict[str, Path] = {}
        # Users live a day (hosts three): a thread issues each file again at half-life, as a deployment's
        # `gpuaas identities renew --every` does (`renew_credentials`); onboarding shares the keys with it.
        self.creds_renew_interval_s = 60.0
        self._keys_lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        self._renewer_stop = threading.Event()

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
    def nats_port(self) -> int:
        from urllib.parse import urlsplit

        port = urlsplit(self.nats_url.split(",")[0]).port
        assert port is not None
        return port

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
            split_servers(self.nats_url),
            str(creds) if creds else None,
            str(self.ca_file) if self.ca_file else None,
            insecure_dev=not self.auth,  # a stack without auth is the open plaintext dev bus
        )
        return ident.connect_kwargs()

    @property
    def authority(self) -> Authority:
        if self._authority is None:
            raise StackError("stack not started with auth")
        return self._authority

    @property
    def admin_dsn(self) -> str:
        """The superuser's DSN on the cluster's maintenance database (no service's tables are there)."""
        if self._admin_dsn is None:
            raise StackError("stack not started")
        return self._admin_dsn

    def dsn_for(self, service: str) -> str:
        """The superuser's DSN on `service`'s own database, where its schema of the same name lives: for tests
        and benchmarks that inspect that service's tables (`scheduler.nodes` on the scheduler's)."""
        if service not in SERVICE_ROLES:
            raise StackError(f"{service!r} has no database; those that do: {', '.join(SERVICE_ROLES)}")
        return service_admin_dsns(self.admin_dsn)[service]

    async def open_databases(self) -> ServiceDatabases:
        """Superuser pools on every service's database, each statement sent where the schema it names lives."""
        return await ServiceDatabases.open(service_admin_dsns(self.admin_dsn))

    def service_dsn(self, service: str) -> str:
        """The DSN `service` runs with: its own role, which owns its schema in its own database and may connect
        to no other."""
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
        """`https://127.0.0.1:<port>` (`http://` only with `maas_insecure_http`): `/MAAS/` and the `/_sim/`
        controls; verify it with `maas_ssl_context`."""
        sim = self._procs.get(MAAS_SIM)
        if sim is None or sim.port is None:
            raise StackError("MAAS simulator not started")
        return f"{'http' if self.maas_insecure_http else 'https'}://127.0.0.1:{sim.port}"

    @property
    def maas_ca_file(self) -> Path | None:
        """The CA that signed the simulator's certificate (the stack's: `<run-dir>/tls/ca.pem`); None when the
        simulator serves plain HTTP."""
        return None if self.maas_insecure_http else self.run_dir / "tls" / "ca.pem"

    @property
    def maas_ssl_context(self) -> ssl.SSLContext | None:
        """A client context that trusts the stack's CA only, for aiohttp (`ssl=`) or urllib (`context=`) calls to
        `maas_base_url`; None for a plain-HTTP simulator."""
        return client_ssl(self.maas_ca_file)

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

    def admin_port(self, service: str) -> int | None:
        """An admin API (scheduler, image-pipeline) binds a port of its own choosing (no race for a
        pre-picked free port) and names it in its ready file."""
        p = self._procs.get(service)
        port = p.info.get("admin_port") if p is not None and p.alive() else None
        return int(port) if port else None

    def admin_url(self, service: str) -> str:
        port = self.admin_port(service)
        if port is None:
            raise StackError(f"the {service} admin API is not up")
        return f"http://127.0.0.1:{port}"

    def admin_token(self, service: str) -> str:
        if service not in ADMIN_APIS:
            raise StackError(f"{service!r} has no admin API; those that do: {', '.join(ADMIN_APIS)}")
        if service not in self._admin_tokens:
            raise StackError("stack not started")
        return self._admin_tokens[service]

    def principal_secret(self, name: str) -> str:
        """One of PRINCIPAL_SECRETS (`billing_token`, `console_token`, `console_login_secret`)."""
        if name not in self._principal_secrets:
            raise StackError(f"stack not started, or {name!r} is none of {', '.join(PRINCIPAL_SECRETS)}")
        return self._principal_secrets[name]

    @property
    def image_admin_url(self) -> str:
        return self.admin_url("image-pipeline")

    @property
    def image_admin_token(self) -> str:
        return self.admin_token("image-pipeline")

    @property
    def scheduler_admin_url(self) -> str:
        return self.admin_url("scheduler")

    @property
    def scheduler_admin_token(self) -> str:
        return self.admin_token("scheduler")

    @property
    def lab_host(self) -> Any:
        """The lab (`gpuaas_dev.lab.lab.Lab`) of a stack started with `lab=True`, else None."""
        return self._lab

    @property
    def lab_image(self) -> dict[str, Any] | None:
        """The lab's slice image as the catalog made it active (slug, digest_sha256, ...), else None."""
        return self._lab_image

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
        if self.auth:
            self._renewer_stop.clear()
            self._renewer = threading.Thread(target=self._renew_loop, name="creds-renewer", daemon=True)
            self._renewer.start()
        return self

    def renew_credentials(self, now: float | None = None) -> list[str]:
        """Issue again every creds file of the run dir past half-life (roles, admin, slice hosts); the
        processes reading them switch to them without a gap. Returns what was renewed. `now`: judge by a later
        clock (a test)."""
        assert self._authority is not None and self._tls is not None
        with self._keys_lock:
            renewed = renew_credentials(self._authority, self.creds_dir, self.nats_options("admin"), self._tls, now)
            self._authority.save(self.run_dir / "keys")
        return renewed

    def _renew_loop(self) -> None:
        while not self._renewer_stop.wait(self.creds_renew_interval_s):
            try:
                renewed = self.renew_credentials()
            except Exception as exc:  # noqa: BLE001 - the bus away for a moment: files have half a life left
                print(f"{time.strftime('%H:%M:%S')} credentials not renewed: {exc}", flush=True)
                continue
            if renewed:
                print(f"{time.strftime('%H:%M:%S')} credentials renewed: {', '.join(renewed)}", flush=True)

    def _start(self) -> None:
        from ..lab.tasks import LAB_PROFILE
        from .lab_host import LAB_IMAGE_TIMEOUT_S, LAB_NODE, lab_fleet_node, publish_lab_image, start_lab_host
        from .lab_machine import HOST_IMAGE_TIMEOUT_S, attach_machine, lab_machine_node, publish_host_image

        self._reset_run_dir()
        self._maas_api_key = str(generate_api_key())
        self._enrolment_secret = secrets.token_hex(32)
        self._admin_tokens = {service: secrets.token_hex(24) for service in ADMIN_APIS}
        self._principal_secrets = {name: secrets.token_hex(24) for name in PRINCIPAL_SECRETS}
        write_secrets(
            self.run_dir / "secrets.json",
            maas_api_key=self._maas_api_key,
            enrolment_secret=self._enrolment_secret,
            admin_tokens=self._admin_tokens,
            principal_secrets=self._principal_secrets,
        )

        # Held before start() so a start that fails half-way is still stopped by stop().
        if self.auth:
            from .lab_machine import GUEST_GATEWAY

            # The lab's machines reach the bus at the bridge's address (the lab forwards it): the certificate names it.
            extra_ips = (GUEST_GATEWAY,) if self.lab_baremetal else ()
            self._tls, self._authority = make_identities(self.run_dir, self.creds_dir, extra_ips)
        if not self.maas_insecure_http:
            # The simulator's certificate from the same CA (made here when the bus has none: auth=False).
            issue_sim_cert(self.run_dir / "tls", ca_exists=self._tls is not None)
        self._nats = NatsCluster(self.run_dir / "nats", size=self.nats_cluster, auth=self._authority, tls=self._tls)
        self._nats.start()
        pg_tls = make_ca_and_server_cert(self.run_dir / "pg-tls") if self.pg_tls else None
        self._pg = PostgresServer(self.run_dir / "pg", unsafe_no_fsync=self.unsafe_no_fsync, tls=pg_tls)
        self._pg.start()
        self._admin_dsn = self._pg.dsn
        self._service_dsns = create_service_roles(self._pg.dsn)
        record_database_secrets(self.run_dir / "secrets.json", self._admin_dsn, self._service_dsns)
        self._registry = RegistryServer(self.run_dir / "registry")
        self._registry.start()

        files = prepare_fleet_dir(
            self.run_dir / "fleet",
            slice_hosts=self.slice_hosts,
            slots_per_host=self.slots_per_host,
            baremetal_hosts=self.baremetal_hosts,
            ssh_port=free_port(),
            hosts_root=self.run_dir / "hosts",
            real_hosts=([lab_fleet_node()] if self.lab else []) + ([lab_machine_node()] if self.lab_baremetal else []),
        )
        self._fleet = Fleet.load(files["fleet"])
        self._files = files
        self._provision_bus()
        self.describe()

        # The simulator picks its own port; the gateway and the agents need it, so it goes first.
        self._procs[MAAS_SIM] = maas_sim_proc(self, port=0)
        spawn(self._procs[MAAS_SIM], self.run_dir)
        self._wait([MAAS_SIM], self.ready_timeout_s)
        if self.auth:
            # Its port is fixed before the gateway is given it, and kept by a restart of the authority.
            self.authority_port = free_port()
            self._procs[AUTHORITY] = service_proc(self, AUTHORITY)
            spawn(self._procs[AUTHORITY], self.run_dir)
            self._wait([AUTHORITY], self.ready_timeout_s)
        for service in SERVICES:
            if service == "ops-view":
                # Its console drains nodes through the scheduler's admin API, on the port the scheduler picks.
                self._wait(self.replica_names("scheduler"), self.ready_timeout_s)
            for name in self.replica_names(service):
                self._procs[name] = service_proc(self, service, name)
                spawn(self._procs[name], self.run_dir)
        self.describe()
        self._wait([name for service in SERVICES for name in self.replica_names(service)], self.ready_timeout_s)
        if self.lab:
            # The lab host onboards with the fleet: up before commissioning and approval, which wait for it.
            from ..lab.preflight import LabUnavailable

            try:
                self._lab = start_lab_host(self)
            except LabUnavailable as exc:
                raise StackError(f"--lab: {exc}") from None
            if self.lab_baremetal:
                # Its `_sim/` power call is a plain urlopen of maas_base_url: verified against the stack's CA.
                with urllib_trusts(self.maas_ca_file):
                    attach_machine(self, self._lab)
        # Slice hosts become slice-capable only with a passing commissioning preflight: commission them
        # through the gateway, as ops would (see stack/preflight.py).
        try:
            # On a thread of its own, like every async step here: the caller may be inside a running loop.
            options, fleet = self.nats_options("admin"), self._fleet
            run_coro(lambda: commission_slice_hosts(options, self.dsn_for("scheduler"), fleet, self.ready_timeout_s))
        except TimeoutError as exc:
            raise StackError(f"{exc}\n--- maas-gateway log ---\n{self.log_tail('maas-gateway')}") from None
        # Seeding fabricates no evidence: slots exist only once the agents reported topology and parity and
        # the candidates were approved through the scheduler's admin API, here as `gpuaas-dev`.
        try:
            url, token = self.scheduler_admin_url, self.scheduler_admin_token
            profiles = {LAB_NODE: LAB_PROFILE} if self.lab else None
            run_coro(lambda: approve_slice_hosts(url, token, fleet, self.ready_timeout_s, profiles))
        except (TimeoutError, ApprovalFailed) as exc:
            raise StackError(f"{exc}\n--- node-agent log ---\n{self.log_tail('node-agent')}") from None
        if self.lab:
            url, token = self.image_admin_url, self.image_admin_token
            try:
                self._lab_image = run_coro(lambda: publish_lab_image(url, token, LAB_IMAGE_TIMEOUT_S))
            except (TimeoutError, RuntimeError) as exc:
                raise StackError(
                    f"--lab: {exc}\n--- image-pipeline log ---\n{self.log_tail('image-pipeline')}"
                ) from None
        if self.lab_baremetal:
            try:
                self._lab_host_image = run_coro(lambda: publish_host_image(url, token, HOST_IMAGE_TIMEOUT_S))
            except (TimeoutError, RuntimeError) as exc:
                raise StackError(f"--lab: {exc}\n--- maas-gateway log ---\n{self.log_tail('maas-gateway')}") from None

    def stop(self) -> None:
        """SIGTERM every process this stack started (by PID), SIGKILL after `stop_timeout_s`."""
        self._renewer_stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=30)
            self._renewer = None
        if self._lab is not None:
            self._lab.down()  # first: its agent talks to the NATS server stopped below
            self._lab = None
        # Reverse start order: consumers go before what they consume from; replicas with their service.
        running = [p for p in reversed(list(self._procs.values())) if p.alive()]
        for p in running:
            send_signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for p in running:
            assert p.proc is not None
            try:
                p.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                send_signal(p, signal.SIGKILL)
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

    def replica_names(self, service: str) -> list[str]:
        """Process names of a service's replicas: `allocator`, `allocator-2`, ... (the fleet is one process)."""
        # One ops-view: its stream consumers have fixed names, and a second follower would take them over.
        if service not in SERVICES or service in ("node-agent", "ops-view") or self.replicas == 1:
            return [service]
        return [service, *(f"{service}-{i}" for i in range(2, self.replicas + 1))]

    @property
    def processes(self) -> list[str]:
        """Every process this stack runs, replicas included, in start order."""
        return list(self._procs)

    @property
    def nats_servers(self) -> list[NatsServer]:
        """The NATS servers, for fault injection: `kill()` one, `start()` it again with its ports and store."""
        if self._nats is None:
            raise StackError("stack not started")
        return self._nats.servers

    def restart_postgres(self, mode: str = "fast", *, synchronous_commit: bool | None = None) -> None:
        """Restart Postgres (`fast` or `immediate`, which skips the shutdown checkpoint like a crash).

        `synchronous_commit=False` brings it back acknowledging commits before they are flushed, so the next
        immediate restart loses the last ones on purpose; `True` makes it durable again."""
        if self._pg is None:
            raise StackError("stack not started")
        self._pg.restart(mode, synchronous_commit=synchronous_commit)

    @property
    def fleet_sim_url(self) -> str:
        """The simulated fleet's observer (`GET /sim/hosts`: each slice host's libvirt domains and DHCP
        reservations), for checkers that compare the control plane's beliefs with what the hosts run."""
        port = self._get("node-agent").info.get("sim_port")
        if not port:
            raise StackError("the simulated fleet is not up")
        return f"http://127.0.0.1:{port}"

    def kill(self, service: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the service's process; for SIGKILL/SIGTERM, return once it has exited."""
        p = self._get(service)
        if not p.alive():
            return
        send_signal(p, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            assert p.proc is not None
            try:
                p.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                send_signal(p, signal.SIGKILL)
                p.proc.wait()
        self.describe()

    def restart(self, service: str) -> None:
        """Stop the service if it runs, start it with the same environment, wait until ready."""
        p = self._get(service)
        if p.alive():
            self.kill(service, signal.SIGTERM)
        if service == MAAS_SIM:
            # Same port again: the gateway and the agents were given this URL.
            p.argv = maas_sim_argv(self, p.port or 0)
        p.restarts += 1
        spawn(p, self.run_dir)
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
        return describe_stack(self)

    # --- internals ----------------------------------------------------------------------------------

    def _get(self, service: str) -> _Proc:
        try:
            return self._procs[service]
        except KeyError:
            raise StackError(f"unknown or not started service {service!r}; known: {', '.join(ALL_PROCESSES)}") from None

    def _reset_run_dir(self) -> None:
        # Every start is a fresh world: NATS state left from an earlier run would not match a new database.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        from .lab_host import clean_leftover_lab

        clean_leftover_lab(self)  # a crashed run's namespace, daemons and loop devices
        for sub in ("nats", "pg", "hosts", "fleet", "ready", "registry", "image-builds", "keys", "creds", "tls"):
            shutil.rmtree(self.run_dir / sub, ignore_errors=True)
        (self.run_dir / "ready").mkdir()
        self.logs_dir.mkdir(exist_ok=True)
        for old in self.logs_dir.glob("*.log"):
            if old.name != "supervisor.log":
                old.unlink()

    def _wait(self, names: list[str], timeout_s: float) -> None:
        wait_until_ready({name: self._get(name) for name in names}, timeout_s)

    def onboard_host(self, node_id: str) -> None:
        """What ops do when a slice host comes back from a baremetal tenant, whose deploy ended its slice
        identity: a new user for it in the creds file its agent reads at every connect, recorded on the bus so
        the gateway can end it again."""
        if not self.auth:
            return
        assert self._authority is not None
        path = self.creds_dir / f"{node_user_name(node_id)}.creds"
        with self._keys_lock:
            before = set(self._authority.issued_hosts.get(node_id, []))
            creds = self._authority.issue_host(node_id)
            path.unlink(missing_ok=True)
            creds_files.write(path, creds)
            self._authority.save(self.run_dir / "keys")
            fresh = [u for u in self._authority.issued_hosts.get(node_id, []) if u not in before]
        provision_bus(
            self.nats_options("admin"),
            [node_id],
            replicas=min(self.nats_cluster, 3),
            host_users={node_id: fresh},
            expiry=self._authority.host_expiry,
        )

    def _provision_bus(self) -> None:
        """Streams and every slice host's durable, as the admin identity: no service or host may."""
        assert self._fleet is not None
        if self.auth:
            assert self._authority is not None
            onboard_slice_hosts(self._authority, self._fleet, self.creds_dir, self.run_dir / "keys")
        options = self.nats_options("admin")
        slice_hosts = [n.node_id for n in self._fleet.nodes if n.kind == "slice_host"]
        provision_bus(
            options,
            slice_hosts,
            replicas=min(self.nats_cluster, 3),
            host_users={n: self._authority.issued_hosts.get(n, []) for n in slice_hosts} if self._authority else None,
            expiry=self._authority.host_expiry if self._authority else None,
        )
