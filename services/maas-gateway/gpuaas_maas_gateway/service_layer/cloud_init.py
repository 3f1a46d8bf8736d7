"""The deploy's user-data: the site's bootstrap cloud-config with the node agent's files added.

Built as data and dumped once, never concatenated as text: a bootstrap with its own `write_files` used
to end up as a second `write_files` key after ours, and YAML keeps only the last one, so the agent's
enrolment env file was silently dropped. Now their `write_files` come first and ours are appended
(cloud-init writes them in order, so ours win on a path clash); every other key of theirs is kept.

A bootstrap must be a cloud-config mapping (with or without the `#cloud-config` header). A shell script,
an `#include`, a MIME multipart or any YAML that is not a mapping is refused with `BootstrapNotCloudConfig`
rather than wrapped in a multipart: the host agent's tooling (and the simulated host) read the agent's
files from a single cloud-config document, and a site profile is configuration ops can fix.
"""

from __future__ import annotations

from typing import Any

import yaml

NODE_ENV_PATH = "/etc/gpuaas/node-agent.env"
NODE_CREDS_PATH = "/etc/gpuaas/node.creds"
# A slice host's agent takes its identity from its unit's environment: a drop-in, so the site's own agent.env
# (bus URL, CA) stays the bootstrap's, and no node-agent.env, whose presence makes the agent a tenant's.
SLICE_DROP_IN_PATH = "/etc/systemd/system/gpuaas-node-agent.service.d/50-slice-host.conf"
HEADER = "#cloud-config"
# The first line of every other user-data format cloud-init knows.
_OTHER_FORMATS = (
    "#!",
    "#include",
    "#cloud-boothook",
    "#part-handler",
    "#upstart-job",
    "#cloud-config-archive",
    "#cloud-config-jsonp",
    "content-type:",
    "mime-version:",
)


class BootstrapNotCloudConfig(ValueError):
    pass


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML has no type stubs here
    """Safe dumping, with multi-line strings as literal blocks: files stay readable as files (and the
    agent's env lines stay one per line, which is how a host reads them back)."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def parse_bootstrap(bootstrap: str) -> dict[str, Any]:
    text = (bootstrap or "").strip()
    if not text:
        return {}
    first = text.splitlines()[0].strip().lower()
    if first != HEADER and first.startswith(_OTHER_FORMATS):
        raise BootstrapNotCloudConfig(
            f"the site bootstrap must be a cloud-config mapping, not {first[:40]!r} user-data"
        )
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BootstrapNotCloudConfig(f"the site bootstrap is not valid YAML: {exc}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise BootstrapNotCloudConfig(f"the site bootstrap must be a cloud-config mapping, got a {type(doc).__name__}")
    if not isinstance(doc.get("write_files") or [], list):
        raise BootstrapNotCloudConfig("the site bootstrap's write_files must be a list")
    return doc


def agent_files(
    token: str, allocation_id: str, node_id: str, system_id: str, creds: str | None = None
) -> list[dict[str, str]]:
    env = (
        f"GPUAAS_NODE_ID={node_id}\nGPUAAS_ALLOCATION_ID={allocation_id}\n"
        f"GPUAAS_MAAS_SYSTEM_ID={system_id}\nGPUAAS_ENROLMENT_TOKEN={token}\n"
    )
    if creds:
        env += f"GPUAAS_NATS_CREDS={NODE_CREDS_PATH}\n"
    files = [{"path": NODE_ENV_PATH, "permissions": "0600", "content": env}]
    if creds:
        # One final newline, as a clipped YAML literal block gives it (what hosts have always received).
        files.append({"path": NODE_CREDS_PATH, "permissions": "0600", "content": creds.rstrip("\n") + "\n"})
    return files


def slice_host_files(node_id: str, creds: str | None = None) -> list[dict[str, str]]:
    env = ["GPUAAS_ROLE=slice_host", f"GPUAAS_NODE_ID={node_id}"]
    if creds:
        env.append(f"GPUAAS_NATS_CREDS={NODE_CREDS_PATH}")
    unit = "[Service]\n" + "".join(f"Environment={line}\n" for line in env)
    files = [{"path": SLICE_DROP_IN_PATH, "permissions": "0644", "content": unit}]
    if creds:
        files.append({"path": NODE_CREDS_PATH, "permissions": "0600", "content": creds.rstrip("\n") + "\n"})
    return files


def render_user_data(
    bootstrap: str,
    token: str,
    allocation_id: str,
    node_id: str,
    system_id: str,
    creds: str | None = None,
    ssh_public_keys: list[str] | tuple[str, ...] = (),
    *,
    slice_host: bool = False,
) -> str:
    """cloud-config that hands the node agent its identity, its one-time enrolment token and, with
    bus identities on, its own short-lived NATS credentials bound to this allocation; and the tenant's SSH
    keys to the image's default user (`ssh_authorized_keys`, after any the site's bootstrap lists). A slice
    host (`slice_host`) gets its node id and creds only: it has no tenant to enrol for."""
    doc = parse_bootstrap(bootstrap)
    ours = (
        slice_host_files(node_id, creds) if slice_host else agent_files(token, allocation_id, node_id, system_id, creds)
    )
    doc["write_files"] = list(doc.get("write_files") or []) + ours
    if ssh_public_keys:
        theirs = doc.get("ssh_authorized_keys") or []
        if not isinstance(theirs, list):
            raise BootstrapNotCloudConfig("the site bootstrap's ssh_authorized_keys must be a list")
        doc["ssh_authorized_keys"] = [*theirs, *(k for k in ssh_public_keys if k not in theirs)]
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return f"{HEADER}\n{body}"
