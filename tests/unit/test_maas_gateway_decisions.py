import pytest

from gpuaas_maas_gateway.domain.operations import Decision, decide, normalise_distro_series


@pytest.mark.parametrize(
    "kind, state, status, untouched, decision",
    [
        ("deploy", "unknown", "Deploying", 0.1, Decision.ACCEPTED),
        ("deploy", "unknown", "Deployed", 0.1, Decision.SUCCEEDED),
        ("deploy", "unknown", "Failed deployment", 0.1, Decision.FAILED),
        ("deploy", "unknown", "Ready", 1.0, Decision.WAIT),
        ("deploy", "unknown", "Ready", 10.0, Decision.RESUBMIT),
        ("deploy", "unknown", "Allocated", 10.0, Decision.RESUBMIT),
        ("deploy", "accepted", "Ready", 10.0, Decision.FAILED),
        ("deploy", "accepted", "Deploying", None, Decision.ACCEPTED),
        ("release", "unknown", "Disk erasing", 0.1, Decision.ACCEPTED),
        ("release", "accepted", "Ready", None, Decision.SUCCEEDED),
        ("release", "unknown", "Deployed", 10.0, Decision.RESUBMIT),
        ("release", "accepted", "Failed disk erasing", None, Decision.FAILED),
        ("deploy", "unknown", "Broken", 0.1, Decision.FAILED),
    ],
)
def test_outcome_decided_only_by_observation(kind, state, status, untouched, decision):
    assert decide(kind, state, status, untouched, grace_s=5.0) is decision


def test_uploaded_image_names_are_normalised():
    uploaded = frozenset({"gpuaas-h200-host"})
    assert normalise_distro_series("gpuaas-h200-host", uploaded) == "custom/gpuaas-h200-host"
    assert normalise_distro_series("custom/gpuaas-h200-host", uploaded) == "custom/gpuaas-h200-host"
    assert normalise_distro_series("noble", uploaded) == "noble"


# ---- commissioning is proved by a new result id -----------------------------------------------------

from gpuaas_maas_gateway.domain.breaker import BreakerState, CircuitBreaker  # noqa: E402
from gpuaas_maas_gateway.domain.operations import decide_commission  # noqa: E402


@pytest.mark.parametrize(
    "state, status, result_id, untouched, decision",
    [
        ("unknown", "Commissioning", 1, 0.1, Decision.ACCEPTED),
        ("unknown", "Testing", 1, 0.1, Decision.ACCEPTED),
        ("unknown", "Ready", 2, 0.1, Decision.SUCCEEDED),  # finished before the first poll
        ("unknown", "Ready", 1, 0.1, Decision.WAIT),  # same run as before: nothing happened yet
        ("unknown", "Ready", 1, 10.0, Decision.RESUBMIT),
        ("unknown", "Failed testing", 2, 0.1, Decision.FAILED),
        ("accepted", "Ready", 2, None, Decision.SUCCEEDED),
        ("accepted", "New", 1, None, Decision.FAILED),
    ],
)
def test_commission_outcome_by_result_id(state, status, result_id, untouched, decision):
    assert decide_commission(state, status, result_id, 1, untouched, grace_s=5.0) is decision


def test_breaker_opens_after_consecutive_connection_failures_and_probes_once():
    b = CircuitBreaker(failures_to_open=3, cooldown_s=10.0)
    assert b.allow(0.0)
    assert not b.failed(0.0) and not b.failed(0.1)
    b.succeeded()  # an answer resets the count
    assert not b.failed(0.2) and not b.failed(0.3)
    assert b.failed(0.4) and b.state is BreakerState.OPEN
    assert not b.allow(5.0) and b.wait_s(5.0) == pytest.approx(5.4)
    assert b.allow(10.5) and b.state is BreakerState.HALF_OPEN
    assert not b.allow(10.6)  # only one trial
    assert b.failed(10.7) and b.state is BreakerState.OPEN and b.opened_count == 2
    assert b.allow(21.0)
    b.released()  # a trial that proved nothing hands the slot back
    assert b.allow(21.1)
    b.succeeded()
    assert b.state is BreakerState.CLOSED and b.allow(21.2) and b.allow(21.2)


def test_sites_keep_the_single_site_settings_working():
    from pydantic import SecretStr

    from gpuaas_maas_gateway.settings import GatewaySettings, MaasSite

    single = GatewaySettings(maas_url="http://a/MAAS/", maas_api_key=SecretStr("a:b:c"))
    assert list(single.sites()) == ["default"] and single.sites()["default"].url == "http://a/MAAS/"
    multi = GatewaySettings(
        maas_url="http://a/MAAS/",
        maas_api_key=SecretStr("a:b:c"),
        maas_sites={"east": MaasSite(url="http://e/MAAS/", api_key=SecretStr("d:e:f"))},
    )
    assert sorted(multi.sites()) == ["default", "east"]
    assert "d:e:f" not in repr(multi) and "a:b:c" not in repr(multi)
