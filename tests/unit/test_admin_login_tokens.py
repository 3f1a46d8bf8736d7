"""The login links and sessions of admin pages (gpuaas_common.admin_http.login): what a token opens, and the
ways a token that should not open anything is turned away."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from urllib.parse import parse_qs, urlparse

import pytest

from gpuaas_common.admin_http.login import LOGIN, LOGIN_PATH, SESSION, _key, login_link, mint, verify

KEYS = {"ops": "ops-token-0123456789", "admin": "admin-token-9876543210"}
NOW = 1_800_000_000.0


def test_a_token_opens_for_its_purpose_until_it_expires() -> None:
    token = mint(KEYS["ops"], "ops", "alice@ops", purpose=LOGIN, ttl_s=600, now=NOW)
    signed, why = verify(KEYS, token, purpose=LOGIN, now=NOW + 599)
    assert why == "" and signed is not None
    assert (signed.principal, signed.actor, signed.expires_at) == ("ops", "alice@ops", NOW + 600)
    assert verify(KEYS, token, purpose=LOGIN, now=NOW + 600) == (None, "the link has expired: ask for a new one")
    assert verify(KEYS, token, purpose=SESSION, now=NOW)[0] is None


def _with_payload(token: str, **changes: object) -> str:
    body, mac = token.split(".")
    fields = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    forged = base64.urlsafe_b64encode(json.dumps({**fields, **changes}).encode()).decode().rstrip("=")
    return f"{forged}.{mac}"


@pytest.mark.parametrize(
    "forge",
    [
        lambda t: _with_payload(t, a="mallory"),  # another person under the same signature
        lambda t: _with_payload(t, x=int(NOW) + 10**6),  # a later expiry
        lambda t: _with_payload(t, p="admin"),  # another principal's key asked to check it
        lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),  # the signature itself
        lambda t: t.split(".")[0],  # no signature
        lambda t: "not-a-token",
        lambda t: "",
    ],
)
def test_a_changed_or_foreign_token_opens_nothing(forge) -> None:
    token = mint(KEYS["ops"], "ops", "alice", purpose=LOGIN, ttl_s=600, now=NOW)
    signed, why = verify(KEYS, forge(token), purpose=LOGIN, now=NOW)
    assert signed is None and why == "the link is not one this console made"


def test_a_token_signed_by_a_token_it_does_not_name_or_an_unknown_principal_opens_nothing() -> None:
    by_admin_key = mint(KEYS["admin"], "ops", "alice", purpose=LOGIN, ttl_s=600, now=NOW)
    assert verify(KEYS, by_admin_key, purpose=LOGIN, now=NOW)[0] is None
    unknown = mint("whatever", "portal", "alice", purpose=LOGIN, ttl_s=600, now=NOW)
    assert verify(KEYS, unknown, purpose=LOGIN, now=NOW)[0] is None
    # Rotating the bearer token ends every link made from the old one.
    old = mint(KEYS["ops"], "ops", "alice", purpose=LOGIN, ttl_s=600, now=NOW)
    assert verify({"ops": "rotated-token-000000000"}, old, purpose=LOGIN, now=NOW)[0] is None


def test_names_must_be_identifiers_and_the_link_carries_the_token() -> None:
    with pytest.raises(ValueError):
        mint(KEYS["ops"], "ops", "alice smith", purpose=LOGIN, ttl_s=600)
    link = login_link("http://127.0.0.1:8083/", KEYS["ops"], "ops", "alice")
    parsed = urlparse(link)
    assert parsed.path == LOGIN_PATH and f"{parsed.scheme}://{parsed.netloc}" == "http://127.0.0.1:8083"
    [token] = parse_qs(parsed.query)["token"]
    signed, _ = verify(KEYS, token, purpose=LOGIN)
    assert signed is not None and signed.actor == "alice"


def _signed_by_hand(fields: dict[str, object]) -> str:
    """A token with these fields, signed with the right key: only its content can be wrong."""
    body = base64.urlsafe_b64encode(json.dumps(fields).encode()).decode().rstrip("=")
    mac = hmac.new(_key(KEYS["ops"], LOGIN), body.encode(), hashlib.sha256).digest()
    return f"{body}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"


def test_every_token_carries_a_nonce_of_its_own_and_one_without_opens_nothing() -> None:
    """The nonce is what the pages' owner records to let a login link in once (Pages.spend_login)."""
    one, two = (
        verify(KEYS, mint(KEYS["ops"], "ops", "alice", purpose=LOGIN, ttl_s=600), purpose=LOGIN)[0] for _ in "ab"
    )
    assert one is not None and two is not None and one.nonce != two.nonce and len(one.nonce) == 32
    base = {"p": "ops", "a": "alice", "x": int(NOW) + 600}
    assert verify(KEYS, _signed_by_hand({**base, "n": "ab" * 16}), purpose=LOGIN, now=NOW)[0] is not None
    for nonce in (None, "", "not hex at all", 12345, "ab"):
        fields = {**base, "n": nonce} if nonce is not None else base
        signed, why = verify(KEYS, _signed_by_hand(fields), purpose=LOGIN, now=NOW)
        assert signed is None and why == "the link is not one this console made", nonce


def test_a_person_assertion_opens_its_one_request_for_a_minute() -> None:
    """The console's assertion of the person it acts for (principals.py) is bound to the request it was made for:
    replayed on another path, with another body or key, signed with another secret, or late, it names no one."""
    from gpuaas_common.admin_http.principals import assert_person, verify_person

    request = {"method": "POST", "path": "/v1/nodes/n1/drain", "body": b'{"reason":"x"}', "idempotency_key": "k1"}
    token = assert_person("console-secret", "alice", "ops-admin", **request, now=NOW)  # type: ignore[arg-type]
    assert verify_person("console-secret", token, **request, now=NOW + 59) == ("alice", "ops-admin")  # type: ignore[arg-type]
    for changed in (
        {"path": "/v1/nodes/n1/undrain"},
        {"method": "PUT"},
        {"body": b'{"reason":"y"}'},
        {"idempotency_key": "k2"},
    ):
        assert verify_person("console-secret", token, **{**request, **changed}, now=NOW) is None, changed  # type: ignore[arg-type]
    assert verify_person("other-secret", token, **request, now=NOW) is None  # type: ignore[arg-type]
    assert verify_person("console-secret", token, **request, now=NOW + 60) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        assert_person("console-secret", "alice", "billing", **request)  # type: ignore[arg-type]


def test_a_person_assertion_names_the_path_however_the_client_quoted_it() -> None:
    """The console quotes a slot id (`slice-01-0000:18:00.0` as `%3A`) and its HTTP client may send it unquoted:
    the assertion is made and checked on the decoded path, so the same request verifies either way."""
    from gpuaas_common.admin_http.principals import assert_person, verify_person

    request = {"method": "POST", "body": b"{}", "idempotency_key": "k1"}
    token = assert_person(
        "console-secret", "alice", "ops-admin", path="/v1/slots/slice-01-0000%3A18%3A00.0/disable", **request, now=NOW
    )  # type: ignore[arg-type]
    assert verify_person(
        "console-secret", token, path="/v1/slots/slice-01-0000:18:00.0/disable", **request, now=NOW
    ) == ("alice", "ops-admin")  # type: ignore[arg-type]
