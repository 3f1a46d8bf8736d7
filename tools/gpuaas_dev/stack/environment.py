"""How the stack starts each process: argv and environment for the MAAS simulator and the five services."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..lab.base_image import default_cache_dir
from .database import database_env
from .identities import nats_env
from .processes import ALL_PROCESSES, MAAS_SIM, _Proc, bin_path

if TYPE_CHECKING:
    from .stack import Stack

# Stack timer names -> `gpuaas maas-sim` flags.
# The gateway's site profile a converting slice host is redeployed with (the scheduler's host walk): the default
# image, with the slice host's identity instead of a tenant's enrolment file.
SLICE_HOST_PROFILE = "h200-slice-host"
TIMER_FLAGS = {
    "deploying": "--deploy-seconds",
    "releasing": "--release-seconds",
    "disk_erasing": "--erase-seconds",
    "commissioning": "--commission-seconds",
    "testing": "--testing-seconds",
}


def base_env(nats_url: str, log_level: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")}
    env.update(
        PYTHONUNBUFFERED="1",
        GPUAAS_NATS_URL=nats_url,
        GPUAAS_HEALTH_HOST="127.0.0.1",
        GPUAAS_HEALTH_PORT="0",
        GPUAAS_LOG_LEVEL=log_level,
    )
    # Keep a developer's opt-outs such as GPUAAS_NO_DOCKER; the stack's own settings win over the rest.
    if "GPUAAS_NO_DOCKER" in os.environ:
        env["GPUAAS_NO_DOCKER"] = os.environ["GPUAAS_NO_DOCKER"]
    return env


def apply_overrides(overrides: Mapping[str, Any], name: str, env: dict[str, str]) -> dict[str, str]:
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            if key == name:
                env.update({k: str(v) for k, v in value.items()})
        elif key not in ALL_PROCESSES:
            env[key] = str(value)
    return env


def maas_sim_argv(stack: Stack, port: int) -> list[str]:
    argv = [
        bin_path("gpuaas"),
        "maas-sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--machines-file",
        str(stack._files["machines"]),
        "--ready-file",
        str(stack.run_dir / "ready" / f"{MAAS_SIM}.json"),
    ]
    for timer, seconds in stack.maas_timers.items():
        argv += [TIMER_FLAGS[timer], str(seconds)]
    if stack.maas_ca_file is not None:
        # Issued by the stack (stack/maas_tls.py) beside its CA; paths, no secret, so argv will do.
        tls = stack.maas_ca_file.parent
        argv += ["--tls-cert", str(tls / f"{MAAS_SIM}.pem"), "--tls-key", str(tls / f"{MAAS_SIM}-key.pem")]
    return argv


def maas_sim_proc(stack: Stack, port: int) -> _Proc:
    env = base_env(stack.nats_url, stack.log_level)
    # Through the environment, not argv: argv is world-readable in the process list.
    env["GPUAAS_MAAS_API_KEY"] = stack.maas_api_key
    return _Proc(
        name=MAAS_SIM,
        argv=maas_sim_argv(stack, port),
        env=apply_overrides(stack.env_overrides, MAAS_SIM, env),
        log_path=stack.logs_dir / f"{MAAS_SIM}.log",
        ready_file=stack.run_dir / "ready" / f"{MAAS_SIM}.json",
        ready_path="/_sim/healthz",
        ready_ca=stack.maas_ca_file,
    )


def service_proc(stack: Stack, name: str, process: str | None = None) -> _Proc:
    """`process` names a replica (`allocator-2`): its own ready file, log and ports, the service's settings."""
    process = process or name
    env = base_env(stack.nats_url, stack.log_level) | database_env(name, stack._service_dsns) | _nats_env(stack, name)
    ready_file = stack.run_dir / "ready" / f"{process}.json"
    env["GPUAAS_READY_FILE"] = str(ready_file)
    files = stack._files
    if name == "allocator":
        env["GPUAAS_ENROLMENT_SECRET"] = stack.enrolment_secret
    elif name == "scheduler":
        env["GPUAAS_INVENTORY_FILE"] = str(files["fleet"])
        # Port 0: the API binds its own and names it in the ready file (stack.json's scheduler_admin_url).
        env.update(
            GPUAAS_ADMIN_PORT="0",
            GPUAAS_ADMIN_TOKEN=stack.admin_token(name),
            GPUAAS_CONSOLE_TOKEN=stack.principal_secret("console_token"),
        )
        if stack.lab:
            # The lab host's slots are emulated (no GPU under TCG): this scheduler, and only a lab's, allows them.
            env["GPUAAS_ALLOW_EMULATED_SLOTS"] = "true"
        if not stack.lab_baremetal:
            # Converting hosts walk back to slice mode by themselves (the lab's gateway has its own profiles).
            env["GPUAAS_SLICE_HOST_PROFILE"] = SLICE_HOST_PROFILE
    elif name == "image-pipeline":
        env["GPUAAS_IMAGE_SEED_FILE"] = str(files["seed"])
        dev_input_dirs = f"{tempfile.gettempdir()},{default_cache_dir()},{stack.run_dir}"
        assert stack._registry is not None
        env.update(
            GPUAAS_REGISTRY_HOST=stack._registry.host,
            GPUAAS_REGISTRY_TLS_MODE="plain-http",
            GPUAAS_ADMIN_PORT="0",
            GPUAAS_ADMIN_TOKEN=stack.admin_token(name),
            GPUAAS_IMAGE_BUILD_DIR=str(stack.run_dir / "image-builds"),
            # The gateway uploads host images by the path the pipeline names; both run on this
            # machine, so a run-dir directory is shared without any gateway setting.
            GPUAAS_HOST_IMAGE_DIR=str(stack.host_image_dir),
            # The dev stack names its customiser: the stamp (no root, no real image, no apt), where a production
            # pipeline's default is the real one.
            GPUAAS_IMAGE_CUSTOMISE="stamp",
            # Where the dev stack's builds read from: the system temp dir (the tests' sources and trees) and
            # the lab's image cache (its slice image). A production pipeline names its own directories.
            GPUAAS_IMAGE_SOURCE_DIRS=dev_input_dirs,
            GPUAAS_HOST_ROOTFS_DIRS=dev_input_dirs,
        )
    elif name == "maas-gateway":
        env["GPUAAS_MAAS_URL"] = stack.maas_url
        if stack.maas_ca_file is not None:
            # https:// with the stack's CA pinned: the MAAS key and the deploys' user-data never travel in clear.
            env["GPUAAS_MAAS_CA_FILE"] = str(stack.maas_ca_file)
        else:
            # A stack a test started with maas_insecure_http: named here, warned about by the gateway at start.
            env["GPUAAS_MAAS_INSECURE_HTTP"] = "true"
        env["GPUAAS_MAAS_API_KEY"] = stack.maas_api_key
        env["GPUAAS_ENROLMENT_SECRET"] = stack.enrolment_secret
        if stack.lab_baremetal:
            from ..lab.host_image import SLUG
            from .lab_machine import gateway_profiles

            env["GPUAAS_SITE_PROFILES"] = gateway_profiles(stack, SLUG)
        else:
            env["GPUAAS_SITE_PROFILES"] = json.dumps({"h200-baremetal": {}, SLICE_HOST_PROFILE: {"slice_host": True}})
    elif name == "ops-view":
        env.update(
            GPUAAS_ADMIN_PORT="0",
            GPUAAS_ADMIN_TOKEN=stack.admin_token(name),
            GPUAAS_BILLING_TOKEN=stack.principal_secret("billing_token"),
            GPUAAS_CONSOLE_LOGIN_SECRET=stack.principal_secret("console_login_secret"),
        )
        if (scheduler := stack.admin_port("scheduler")) is not None:
            # The console's drain and its nodes' admin state, through the scheduler's admin API (up first), with the
            # console's own token (never the scheduler's admin token).
            env.update(
                GPUAAS_SCHEDULER_ADMIN_URL=f"http://127.0.0.1:{scheduler}",
                GPUAAS_SCHEDULER_CONSOLE_TOKEN=stack.principal_secret("console_token"),
            )
    elif name == "node-agent":
        env["GPUAAS_FLEET_FILE"] = str(files["fleet"])
        env["GPUAAS_MAAS_SIM_URL"] = stack.maas_base_url
        # The simulated machines read their deploy's user-data with the simulator's key, as a machine with its own.
        env["GPUAAS_MAAS_SIM_API_KEY"] = stack.maas_api_key
        if stack.maas_ca_file is not None:
            env["GPUAAS_MAAS_SIM_CA_FILE"] = str(stack.maas_ca_file)
        env["GPUAAS_SIM_IMAGE_DIR"] = str(files["images"])
        env["GPUAAS_LIBVIRT_URI"] = "test:///default"
    # The node agent's place in the stack is taken by the simulated fleet: every host in one process.
    command = "gpuaas-sim-fleet" if name == "node-agent" else f"gpuaas-{name}"
    return _Proc(
        name=process,
        argv=[bin_path(command)],
        env=apply_overrides(stack.env_overrides, name, env),
        log_path=stack.logs_dir / f"{process}.log",
        ready_file=ready_file,
        ready_path="/readyz",
    )


def _nats_env(stack: Stack, name: str) -> dict[str, str]:
    if not stack.auth:
        # An open bus without TLS: the services must be told by name that plaintext is meant.
        return {"GPUAAS_NATS_INSECURE_DEV": "true"}
    assert stack._tls is not None
    return nats_env(name, stack._tls, stack.creds_dir, stack.run_dir / "keys", stack.authority_port)
