"""The deploy user-data: the site's bootstrap merged with the node agent's files, read back as a host would
(cloud-init's write_files as the simulated machine applies them, then the production agent's reader)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from gpuaas_common.enrolment import enrolment_proof, enrolment_token, token_proof
from gpuaas_dev.sim.baremetal import write_cloud_init_files
from gpuaas_maas_gateway.service_layer.cloud_init import BootstrapNotCloudConfig, render_user_data
from gpuaas_node_agent.adapters.node_env import creds_file, read_node_env

CREDS = (
    "-----BEGIN NATS USER JWT-----\n"
    "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.sig\n------END NATS USER JWT------\n"
    "\n************************* IMPORTANT *************************\n"
    "NKEY Seed printed below can be used to sign and prove identity.\n\n"
    "-----BEGIN USER NKEY SEED-----\nSUAEXAMPLESEED\n------END USER NKEY SEED------\n\n"
    "*************************************************************\n"
)
ALLOC = "6f1c2a8e-0d7b-4c39-9a51-3e2f4b6d8c10"
TOKEN = enrolment_token("secret", ALLOC, "sys1")
ENV = {
    "GPUAAS_NODE_ID": "bm-01",
    "GPUAAS_ALLOCATION_ID": ALLOC,
    "GPUAAS_MAAS_SYSTEM_ID": "sys1",
    "GPUAAS_ENROLMENT_TOKEN": TOKEN,
}


def render(bootstrap: str, creds: str | None = CREDS) -> str:
    return render_user_data(bootstrap, TOKEN, ALLOC, "bm-01", "sys1", creds)


def files(user_data: str) -> dict[str, dict[str, str]]:
    return {f["path"]: f for f in yaml.safe_load(user_data)["write_files"]}


def test_a_bootstrap_with_its_own_write_files_keeps_the_agent_files_and_its_own(tmp_path: Path) -> None:
    bootstrap = (
        "#cloud-config\npackages: [ipmitool]\nwrite_files:\n  - path: /etc/site/motd\n    content: hello\n"
        "runcmd:\n  - [systemctl, restart, site-agent]\n"
    )
    user_data = render(bootstrap)

    assert user_data.startswith("#cloud-config\n")
    doc = yaml.safe_load(user_data)
    assert [f["path"] for f in doc["write_files"]] == [
        "/etc/site/motd",
        "/etc/gpuaas/node-agent.env",
        "/etc/gpuaas/node.creds",
    ]
    assert doc["packages"] == ["ipmitool"] and doc["runcmd"] == [["systemctl", "restart", "site-agent"]]
    env_file = files(user_data)["/etc/gpuaas/node-agent.env"]
    assert env_file["permissions"] == "0600"
    assert dict(line.split("=", 1) for line in env_file["content"].splitlines()) == {
        **ENV,
        "GPUAAS_NATS_CREDS": "/etc/gpuaas/node.creds",
    }
    # What the host's agent reads back once cloud-init wrote the files.
    write_cloud_init_files(user_data, tmp_path)
    identity = read_node_env(tmp_path)
    assert (identity.node_id, identity.allocation_id, identity.maas_system_id) == ("bm-01", uuid.UUID(ALLOC), "sys1")
    assert identity.token == TOKEN and identity.creds_path == "/etc/gpuaas/node.creds"
    assert Path(creds_file(tmp_path, identity) or "").read_text() == CREDS
    assert (tmp_path / "etc/gpuaas/node.creds").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "etc/site/motd").read_text() == "hello"


def test_the_creds_file_is_written_as_before() -> None:
    creds = files(render(""))["/etc/gpuaas/node.creds"]
    assert creds == {"path": "/etc/gpuaas/node.creds", "permissions": "0600", "content": CREDS}
    # Trailing blank lines were always clipped to one newline by the literal block it was written as.
    assert files(render("", creds=CREDS + "\n\n"))["/etc/gpuaas/node.creds"]["content"] == CREDS


def test_without_creds_there_is_no_creds_file_and_no_creds_line(tmp_path: Path) -> None:
    user_data = render("runcmd: [site-bootstrap]", creds=None)
    assert list(files(user_data)) == ["/etc/gpuaas/node-agent.env"]
    write_cloud_init_files(user_data, tmp_path)
    identity = read_node_env(tmp_path)
    assert identity.creds_path is None and creds_file(tmp_path, identity) is None
    assert yaml.safe_load(user_data)["runcmd"] == ["site-bootstrap"]


@pytest.mark.parametrize(
    "bootstrap",
    [
        "#!/bin/sh\necho hi\n",
        "#include\nhttps://example.com/cloud-config\n",
        'Content-Type: multipart/mixed; boundary="x"\n',
        "- just\n- a list\n",
        "write_files: /etc/motd\n",
        "runcmd: [unclosed\n",
    ],
)
def test_a_bootstrap_that_is_not_a_cloud_config_mapping_is_refused(bootstrap: str) -> None:
    with pytest.raises(BootstrapNotCloudConfig):
        render(bootstrap)


def test_enrolment_proof_is_the_sha256_of_the_token_the_gateway_writes() -> None:
    token = enrolment_token("secret", "a-1", "sys1")
    assert enrolment_proof("secret", "a-1", "sys1") == token_proof(token)
    assert enrolment_proof("secret", "a-1", "sys2") != token_proof(token)
    assert enrolment_proof("other", "a-1", "sys1") != token_proof(token)


def test_the_tenants_keys_go_to_the_default_user_after_the_sites_own() -> None:
    site_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOps ops@site"
    tenant = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITenant t@laptop", site_key]
    bootstrap = f"#cloud-config\nssh_authorized_keys:\n  - {site_key}\n"
    doc = yaml.safe_load(render_user_data(bootstrap, TOKEN, ALLOC, "bm-01", "sys1", CREDS, ssh_public_keys=tenant))
    # Once each, the site's first: cloud-init appends them to the default user's authorized_keys in this order.
    assert doc["ssh_authorized_keys"] == [site_key, tenant[0]]
    assert "ssh_authorized_keys" not in yaml.safe_load(render("#cloud-config\n{}\n"))


def test_a_bootstrap_whose_keys_are_not_a_list_is_refused() -> None:
    with pytest.raises(BootstrapNotCloudConfig, match="ssh_authorized_keys"):
        render_user_data("ssh_authorized_keys: one-key\n", TOKEN, ALLOC, "bm-01", "sys1", ssh_public_keys=["k"])


def test_a_slice_host_deploy_gives_the_host_its_node_id_and_creds_and_no_tenants_enrolment_file(
    tmp_path: Path,
) -> None:
    from gpuaas_node_agent.adapters.node_env import node_env_present
    from gpuaas_node_agent.domain.baremetal import choose_role

    text = render_user_data("", TOKEN, ALLOC, "slice-07", "sys1", CREDS, slice_host=True)
    write_cloud_init_files(text, tmp_path)
    # The agent's own rule reads the host as a slice host: no node-agent.env, which only a tenant's deploy writes.
    assert not node_env_present(tmp_path) and choose_role("slice_host", node_env_present(tmp_path)) == "slice_host"
    unit = (tmp_path / "etc/systemd/system/gpuaas-node-agent.service.d/50-slice-host.conf").read_text()
    assert unit.splitlines() == [
        "[Service]",
        "Environment=GPUAAS_ROLE=slice_host",
        "Environment=GPUAAS_NODE_ID=slice-07",
        "Environment=GPUAAS_NATS_CREDS=/etc/gpuaas/node.creds",
    ]
    assert (tmp_path / "etc/gpuaas/node.creds").read_text() == CREDS
    assert TOKEN not in text and ALLOC not in text  # nothing of an enrolment: there is no tenant
