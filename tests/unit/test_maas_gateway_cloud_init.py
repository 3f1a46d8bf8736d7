"""The deploy user-data: the site's bootstrap merged with the node agent's files, read back as a host would."""

from __future__ import annotations

import pytest
import yaml

from gpuaas_common.enrolment import enrolment_proof, enrolment_token, token_proof
from gpuaas_dev.sim.baremetal import parse_agent_env, parse_node_creds
from gpuaas_maas_gateway.service_layer.cloud_init import BootstrapNotCloudConfig, render_user_data

CREDS = (
    "-----BEGIN NATS USER JWT-----\n"
    "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.sig\n------END NATS USER JWT------\n"
    "\n************************* IMPORTANT *************************\n"
    "NKEY Seed printed below can be used to sign and prove identity.\n\n"
    "-----BEGIN USER NKEY SEED-----\nSUAEXAMPLESEED\n------END USER NKEY SEED------\n\n"
    "*************************************************************\n"
)
ENV = {
    "GPUAAS_NODE_ID": "bm-01",
    "GPUAAS_ALLOCATION_ID": "a-1",
    "GPUAAS_MAAS_SYSTEM_ID": "sys1",
    "GPUAAS_ENROLMENT_TOKEN": "tok",
}


def render(bootstrap: str, creds: str | None = CREDS) -> str:
    return render_user_data(bootstrap, "tok", "a-1", "bm-01", "sys1", creds)


def files(user_data: str) -> dict[str, dict[str, str]]:
    return {f["path"]: f for f in yaml.safe_load(user_data)["write_files"]}


def test_a_bootstrap_with_its_own_write_files_keeps_the_agent_files_and_its_own() -> None:
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
    # What the (simulated) host reads back.
    assert parse_agent_env(user_data) == {**ENV, "GPUAAS_NATS_CREDS": "/etc/gpuaas/node.creds"}
    assert parse_node_creds(user_data) == CREDS


def test_the_creds_file_is_written_as_before() -> None:
    creds = files(render(""))["/etc/gpuaas/node.creds"]
    assert creds == {"path": "/etc/gpuaas/node.creds", "permissions": "0600", "content": CREDS}
    # Trailing blank lines were always clipped to one newline by the literal block it was written as.
    assert files(render("", creds=CREDS + "\n\n"))["/etc/gpuaas/node.creds"]["content"] == CREDS


def test_without_creds_there_is_no_creds_file_and_no_creds_line() -> None:
    user_data = render("runcmd: [site-bootstrap]", creds=None)
    assert list(files(user_data)) == ["/etc/gpuaas/node-agent.env"]
    assert parse_agent_env(user_data) == ENV
    assert parse_node_creds(user_data) is None
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
