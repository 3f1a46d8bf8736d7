"""The files cloud-init wrote for a baremetal host's agent, read under the agent's host root."""

from __future__ import annotations

from pathlib import Path

from ..domain.baremetal import NODE_ENV_PATH, BaremetalIdentity, NodeEnvInvalid, parse_node_env


def _under(root: Path, host_path: str) -> Path:
    return root / host_path.lstrip("/")


def node_env_present(root: Path) -> bool:
    return _under(root, NODE_ENV_PATH).exists()


def read_node_env(root: Path) -> BaremetalIdentity:
    path = _under(root, NODE_ENV_PATH)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NodeEnvInvalid(f"{NODE_ENV_PATH} is not there: the deploy's user-data did not reach this host") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NodeEnvInvalid(f"{NODE_ENV_PATH} cannot be read: {type(exc).__name__}") from None
    identity = parse_node_env(text)
    if identity.creds_path is not None and not _under(root, identity.creds_path).is_file():
        raise NodeEnvInvalid(f"{NODE_ENV_PATH} names GPUAAS_NATS_CREDS={identity.creds_path}, which is not there")
    return identity


def creds_file(root: Path, identity: BaremetalIdentity) -> str | None:
    """Where the agent opens the creds file the env file names (the host path seen through the root)."""
    return str(_under(root, identity.creds_path)) if identity.creds_path else None


def host_uptime(root: Path) -> float | None:
    """Seconds since the host's kernel started (/proc/uptime under the host root), or None where the root has no
    /proc (a simulated host's tree): no made-up boot time is reported."""
    try:
        return float(_under(root, "/proc/uptime").read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return None
