"""Hosts are users of an account of their own (HOSTS), which imports from GPUAAS only what the host template
allows; the reply-subject reflection this closes is shown against a real server in
tests/integration/test_bus_reply_reflection.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuaas_common.identity import Authority, AuthorityError, Issuer
from gpuaas_common.identity.authority import host_service_exports
from gpuaas_common.identity.jwt import decode
from gpuaas_common.identity.permissions import (
    HOST_JS_API,
    ROLE_PERMISSIONS,
    baremetal_permissions,
    gpuaas_subject,
    host_js_api,
    node_permissions,
)


def test_gpuaas_exports_to_hosts_exactly_what_the_host_template_names() -> None:
    auth = Authority.create()
    gpuaas = decode(auth.account_jwt())["nats"]
    hosts = decode(auth.hosts_account_jwt())["nats"]
    assert hosts.get("limits", {}).get("disk_storage") is None, "HOSTS has no JetStream of its own"
    # The scoped key signs hosts in HOSTS only; GPUAAS keeps its plain key alone.
    assert gpuaas["signing_keys"] == [auth.account_signing.public]
    # Two scoped keys: a slice host's template and a baremetal tenant's host's, each key its own template.
    scoped = {k["key"]: k for k in hosts["signing_keys"]}
    assert set(scoped) == {auth.node_signing.public, auth.baremetal_signing.public}
    assert {k["kind"] for k in scoped.values()} == {"user_scope"}
    assert scoped[auth.baremetal_signing.public]["template"]["pub"]["allow"] == [
        "gpuaas.node.{{tag(node)}}.report.enrolled"
    ]
    exported = {e["subject"]: e["response_type"] for e in gpuaas["exports"]}
    imported = {i["subject"]: i["local_subject"] for i in hosts["imports"]}
    assert set(exported) == set(imported) and {i["account"] for i in hosts["imports"]} == {auth.account.public}
    assert exported["$JS.API.CONSUMER.MSG.NEXT.NODE_TASKS.*"] == "Stream"  # a pull is answered many times
    assert imported["$JS.API.CONSUMER.INFO.NODE_TASKS.*"] == f"{HOST_JS_API}.CONSUMER.INFO.NODE_TASKS.*"
    assert imported["gpuaas.node.*.report.task_result"] == "gpuaas.node.*.report.task_result"
    assert not [s for s in exported if s.startswith(("gpuaas.allocation", "gpuaas.maas", "$JS.API.STREAM"))]
    # Every subject one host may publish on is in an import; nothing else of the host's own is.
    n1 = node_permissions("n1").pub_allow
    assert len(n1) == len(host_service_exports())
    assert all(any(_matches(local, s) for _, local, _ in host_service_exports()) for s in n1)
    assert set(baremetal_permissions("bm1").pub_allow) <= set(node_permissions("bm1").pub_allow)
    # No host may dead-letter: its letters would be rows in ops' database at its own rate.
    assert not [s for s in exported if s.startswith("gpuaas.dlq")]


def _matches(pattern: str, subject: str) -> bool:
    want, have = pattern.split("."), subject.split(".")
    if want[-1] == ">":
        return len(have) >= len(want) and all(w in ("*", h) for w, h in zip(want[:-1], have, strict=False))
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=True))


def test_host_users_are_issued_in_hosts_and_everyone_else_in_gpuaas() -> None:
    auth = Authority.create()
    assert auth.issue_host("n1").claims["nats"]["issuer_account"] == auth.hosts_account.public
    node = auth.issuer().issue_node("bm-1", ttl_s=60, allocation_id="a")
    assert node.claims["nats"]["issuer_account"] == auth.hosts_account.public
    # A baremetal tenant's host user is signed by the baremetal key (its template), a slice host's by the other.
    assert node.claims["iss"] == auth.baremetal_signing.public != auth.issue_host("n2").claims["iss"]
    assert auth.issue_user("ops", ROLE_PERMISSIONS["ops"]).claims["nats"]["issuer_account"] == auth.account.public
    assert auth.hosts_account.public in auth.server_config(Path("/resolver"))


def test_keys_saved_before_hosts_existed_derive_the_same_hosts_account_everywhere(tmp_path: Path) -> None:
    auth = Authority.create()
    auth.save(tmp_path / "keys")
    assert Authority.load(tmp_path / "keys").hosts_account.public == auth.hosts_account.public
    (tmp_path / "keys" / "hosts_account.nk").unlink()
    first, second = Authority.load(tmp_path / "keys"), Authority.load(tmp_path / "keys")
    assert first.hosts_account.public == second.hosts_account.public != auth.account.public
    assert first.hosts_account.public.startswith("A")
    assert Authority.load(tmp_path / "keys").baremetal_signing.public == auth.baremetal_signing.public
    (tmp_path / "keys" / "baremetal_signing.nk").unlink()
    first, second = Authority.load(tmp_path / "keys"), Authority.load(tmp_path / "keys")
    assert first.baremetal_signing.public == second.baremetal_signing.public
    assert first.baremetal_signing.public not in (first.hosts_account.public, first.node_signing.public)


def test_an_issuer_file_from_before_hosts_refuses_to_mint_rather_than_mint_in_the_wrong_account(
    tmp_path: Path,
) -> None:
    issuer = Authority.create().issuer()
    assert (
        Issuer.load(_written(tmp_path / "new.json", issuer.dump())).hosts_account_public == issuer.hosts_account_public
    )
    old = json.loads(issuer.dump())
    del old["hosts_account_public"]
    stale = Issuer.load(_written(tmp_path / "old.json", json.dumps(old)))
    with pytest.raises(AuthorityError, match="predates the HOSTS account"):
        stale.issue_node("bm-1", ttl_s=60)


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_hosts_jetstream_api_requests_but_pulls_go_under_its_own_prefix() -> None:
    info = "$JS.API.CONSUMER.INFO.NODE_TASKS.node-agent-n1"
    assert host_js_api(info) == f"{HOST_JS_API}.CONSUMER.INFO.NODE_TASKS.node-agent-n1"
    assert gpuaas_subject(host_js_api(info)) == info
    for kept in (
        "$JS.API.CONSUMER.MSG.NEXT.NODE_TASKS.node-agent-n1",
        "$JS.ACK.NODE_TASKS.node-agent-n1.>",
        "gpuaas.x",
    ):
        assert host_js_api(kept) == kept == gpuaas_subject(kept)
