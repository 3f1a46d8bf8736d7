"""The credential authority's request check (`gpuaas_common.identity.signed_request`), case by case: what a caller
must show, and the named refusal for each thing that can be wrong."""

from __future__ import annotations

import time

import pytest

from gpuaas_common.identity import Authority
from gpuaas_common.identity.permissions import ROLE_PERMISSIONS
from gpuaas_common.identity.signed_request import MAX_SKEW_S, NonceCache, RequestRefused, Trust, sign, verify

PATH, BODY = "/v1/host-users", b'{"node_id": "bm-01"}'


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority.create()


@pytest.fixture(scope="module")
def trust(authority: Authority) -> Trust:
    return Trust(authority.account.public, frozenset({authority.account_signing.public}), frozenset({"maas-gateway"}))


def _user(authority: Authority, role: str = "maas-gateway", ttl_s: float = 3600):
    return authority.issue_user(role, ROLE_PERMISSIONS[role], ttl_s=ttl_s)


def _check(header, trust, *, body=BODY, revoked=(), nonces=None, now=None, method="POST", path=PATH):
    # The real clock by default: users are minted with expiries from it.
    return verify(header, method, path, body, trust=trust, revoked=revoked, nonces=nonces or NonceCache(), now=now)


def test_a_fresh_request_signed_by_an_allowed_role_is_served(authority: Authority, trust: Trust) -> None:
    gateway = _user(authority)
    claims = _check(sign(gateway, "POST", PATH, BODY), trust)
    assert claims["name"] == "maas-gateway" and claims["sub"] == gateway.claims["sub"]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("no header", "unsigned"),
        ("bearer", "unsigned"),
        ("garbled", "malformed_signature"),
        ("another deployment's account", "foreign_jwt"),
        ("a role not allowed", "not_allowed"),
        ("expired user", "expired"),
        ("revoked user", "revoked"),
        ("an hour old", "stale"),
        ("another body", "bad_signature"),
        ("another path", "bad_signature"),
        ("another method", "bad_signature"),
        ("a JWT with a forged signature", "bad_jwt"),
    ],
)
def test_each_fault_is_refused_by_name(authority: Authority, trust: Trust, case: str, reason: str) -> None:
    gateway = _user(authority)
    good = sign(gateway, "POST", PATH, BODY)
    kw: dict = {}
    header: str | None = good
    if case == "no header":
        header = None
    elif case == "bearer":
        header = "Bearer abc"
    elif case == "garbled":
        header = good.split(",sig=")[0]
    elif case == "another deployment's account":
        header = sign(_user(Authority.create()), "POST", PATH, BODY)
    elif case == "a role not allowed":
        header = sign(_user(authority, "scheduler"), "POST", PATH, BODY)
    elif case == "expired user":
        header = sign(_user(authority, ttl_s=-10), "POST", PATH, BODY)
    elif case == "revoked user":
        kw["revoked"] = {str(gateway.claims["sub"]): 1}
    elif case == "an hour old":
        header = sign(gateway, "POST", PATH, BODY, now=time.time() - 3600)
    elif case == "another body":
        kw["body"] = b'{"node_id": "slice-09"}'
    elif case == "another path":
        kw["path"] = "/v1/allocations/x/revoke"
    elif case == "another method":
        kw["method"] = "PUT"
    elif case == "a JWT with a forged signature":
        jwt = gateway.jwt
        header = good.replace(jwt, jwt[:-4] + ("AAAA" if not jwt.endswith("AAAA") else "BBBB"))
    with pytest.raises(RequestRefused) as refused:
        _check(header, trust, **kw)
    assert refused.value.reason == reason
    assert refused.value.status == (403 if reason == "not_allowed" else 401)


def test_a_request_is_served_once(authority: Authority, trust: Trust) -> None:
    header, nonces = sign(_user(authority), "POST", PATH, BODY), NonceCache()
    _check(header, trust, nonces=nonces)
    with pytest.raises(RequestRefused, match="already served"):
        _check(header, trust, nonces=nonces)


def test_the_nonce_cache_forgets_only_what_the_clock_check_refuses_anyway() -> None:
    nonces, NOW = NonceCache(window_s=2 * MAX_SKEW_S), time.time()
    assert nonces.first_use("a", NOW)
    assert not nonces.first_use("a", NOW + MAX_SKEW_S)
    assert nonces.first_use("b", NOW + 3 * MAX_SKEW_S)  # "a" is forgotten: its timestamp is stale by now
    assert nonces.first_use("a", NOW + 3 * MAX_SKEW_S)
