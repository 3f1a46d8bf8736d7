"""What a caller may ask the credential authority for (`gpuaas_credential_authority.domain.grants`)."""

from __future__ import annotations

import uuid

import pytest

from gpuaas_credential_authority.domain.grants import MIN_TTL_S, GrantRefused, host_user_grant, slice_host_grant

ALLOC = str(uuid.uuid4())


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (None, "body"),
        ([], "body"),
        ({"node_id": "bm-01"}, "allocation_id"),
        ({"node_id": "a.b", "allocation_id": ALLOC}, "node_id"),
        ({"node_id": "a>", "allocation_id": ALLOC}, "node_id"),
        ({"node_id": "*", "allocation_id": ALLOC}, "node_id"),
        ({"node_id": "", "allocation_id": ALLOC}, "node_id"),
        ({"node_id": "x" * 129, "allocation_id": ALLOC}, "node_id"),
        ({"node_id": 7, "allocation_id": ALLOC}, "node_id"),
        ({"node_id": "bm-01", "allocation_id": "allocation:1"}, "allocation_id"),
        ({"node_id": "bm-01", "allocation_id": ALLOC, "ttl_s": "3600"}, "ttl_s"),
        ({"node_id": "bm-01", "allocation_id": ALLOC, "ttl_s": True}, "ttl_s"),
        ({"node_id": "bm-01", "allocation_id": ALLOC, "ttl_s": MIN_TTL_S - 1}, "ttl_s"),
        ({"node_id": "bm-01", "allocation_id": ALLOC}, "deploy_command_seq"),
        ({"node_id": "bm-01", "allocation_id": ALLOC, "deploy_command_seq": 0}, "deploy_command_seq"),
        ({"node_id": "bm-01", "allocation_id": ALLOC, "deploy_command_seq": "7"}, "deploy_command_seq"),
        ({"node_id": "bm-01", "allocation_id": ALLOC, "deploy_command_seq": True}, "deploy_command_seq"),
        ({"node_id": "bm-01", "allocation_id": ALLOC, "deploy_command_seq": 7.5}, "deploy_command_seq"),
    ],
)
def test_a_grant_that_could_widen_the_host_template_is_refused_with_its_field(body: object, field: str) -> None:
    with pytest.raises(GrantRefused) as refused:
        host_user_grant(body, max_ttl_s=3600)
    assert refused.value.field == field


def test_a_lifetime_is_capped_and_ids_kept_as_the_contract_has_them() -> None:
    body = {"node_id": "bm:01", "allocation_id": ALLOC.upper(), "ttl_s": 10**9, "deploy_command_seq": 12}
    grant = host_user_grant(body, max_ttl_s=3600)
    assert (grant.node_id, grant.allocation_id, grant.ttl_s, grant.deploy_command_seq) == ("bm:01", ALLOC, 3600, 12)
    body = {"node_id": "bm-01", "allocation_id": ALLOC, "deploy_command_seq": 1}
    assert host_user_grant(body, max_ttl_s=600).ttl_s == 600


@pytest.mark.parametrize(
    ("node", "body", "field"),
    [
        ("bm-01", None, "body"),
        ("a.b", {"walk_id": ALLOC, "deploy_command_seq": 3}, "node_id"),
        ("bm-01", {"deploy_command_seq": 3}, "walk_id"),
        ("bm-01", {"walk_id": "walk-1", "deploy_command_seq": 3}, "walk_id"),
        ("bm-01", {"walk_id": ALLOC}, "deploy_command_seq"),
        ("bm-01", {"walk_id": ALLOC, "deploy_command_seq": -3}, "deploy_command_seq"),
    ],
)
def test_a_slice_host_grant_names_its_node_walk_and_deploy_command(node: str, body: object, field: str) -> None:
    with pytest.raises(GrantRefused) as refused:
        slice_host_grant(node, body)
    assert refused.value.field == field


def test_a_slice_host_grant_keeps_the_walk_id_as_the_contract_has_it() -> None:
    grant = slice_host_grant("bm:01", {"walk_id": ALLOC.upper(), "deploy_command_seq": 9})
    assert (grant.node_id, grant.walk_id, grant.deploy_command_seq) == ("bm:01", ALLOC, 9)
