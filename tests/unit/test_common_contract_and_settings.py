import pytest
from pydantic import ValidationError

from gpuaas_common.bus import PermanentError, parse_message, retry_delay
from gpuaas_common.contract import ALL, Envelope, derived_event_id, spec_for, types_for_subject
from gpuaas_common.contract.catalog import NODE_TASK_TYPES, node_task_subject
from gpuaas_common.jetstream import node_agent_consumer, subject_matches
from gpuaas_common.settings import ServiceSettings


def test_subjects_are_built_from_validated_parameters():
    spec = spec_for("slice.vm_provision")
    assert spec.subject(node_id="slice-01") == "gpuaas.node.slice-01.tasks.slice.vm_provision"
    with pytest.raises(ValueError):
        spec.subject(node_id="a.b")  # a dot would escape into another subject level
    with pytest.raises(ValueError):
        spec.subject()


def test_each_node_task_type_has_a_subject_of_its_own():
    """N6: one subject per task type under the host's tasks, so the server's per-subject rights say which
    service may send which type; no subject carries two task types, and none is outside the host's durable."""
    assert {"slice.vm_provision", "slice.vm_release", "slice.terminal_open", "image.cache_prewarm"} <= set(
        NODE_TASK_TYPES
    )
    for type_ in NODE_TASK_TYPES:
        subject = node_task_subject(type_, "slice-02")
        assert subject == f"gpuaas.node.slice-02.tasks.{type_}"
        assert [s.type for s in types_for_subject(subject)] == [type_]
        assert subject_matches(node_agent_consumer("slice-02").filter_subject, subject)
    assert types_for_subject("gpuaas.node.slice-02.tasks") == [], "the old shared subject carries nothing now"
    # Every message the agent consumes on its task durable is a node task: none is left on another subject.
    on_durable = {s.type for s in ALL if "node-agent" in s.consumers and s.address and ".tasks" in s.address}
    assert on_durable == set(NODE_TASK_TYPES)
    with pytest.raises(KeyError):
        node_task_subject("allocation.requested", "slice-02")
    assert types_for_subject("gpuaas.node.slice-02.report.topology")[0].type == "node.topology_reported"


def test_derived_event_ids_are_stable():
    assert derived_event_id("a", "b") == derived_event_id("a", "b") != derived_event_id("a", "c")


def test_parse_message_rejects_a_type_on_the_wrong_subject():
    env = Envelope.wrap(
        "allocation.release_requested",
        {"allocation_id": "6d3f7d1e-8f9a-4a49-9c1e-0d7a4f1b2c3d"},
        producer="t",
        correlation_id="c",
    )
    parse_message("gpuaas.allocation.release_requested", env.model_dump_json().encode())
    with pytest.raises(PermanentError) as err:
        parse_message("gpuaas.allocation.requested", env.model_dump_json().encode())
    assert err.value.reason_code == "schema_invalid"


def test_retry_delays_grow_then_hold():
    delays = (0.1, 0.5, 2.0)
    assert [retry_delay(delays, n) for n in (1, 2, 3, 4, 9)] == [0.1, 0.5, 2.0, 2.0, 2.0]


def test_settings_come_from_the_environment_and_are_validated(monkeypatch):
    monkeypatch.setenv("GPUAAS_NATS_URL", "nats://127.0.0.1:4999")
    monkeypatch.setenv("GPUAAS_LOG_LEVEL", "debug")
    s = ServiceSettings()
    assert s.nats_url == "nats://127.0.0.1:4999" and s.log_level == "DEBUG"
    assert "secret" not in repr(ServiceSettings(database_url="postgresql://u:secret@h/db"))
    monkeypatch.setenv("GPUAAS_NATS_URL", "http://wrong")
    with pytest.raises(ValidationError):
        ServiceSettings()
