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
