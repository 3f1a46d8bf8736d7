"""The agent's check that a task came on its own type's subject (domain/task_routing.py)."""

from __future__ import annotations

from gpuaas_common.contract.catalog import NODE_TASK_TYPES, node_task_subject
from gpuaas_node_agent.domain.task_routing import misrouted_task


def test_each_task_type_is_taken_on_its_own_subject_only() -> None:
    for type_ in NODE_TASK_TYPES:
        assert misrouted_task("n1", node_task_subject(type_, "n1"), {"type": type_}) is None
        for other in set(NODE_TASK_TYPES) - {type_}:
            why = misrouted_task("n1", node_task_subject(other, "n1"), {"type": type_})
            assert why is not None and f"{type_} travels on {node_task_subject(type_, 'n1')}" in why


def test_a_message_that_is_no_node_task_is_refused_and_a_malformed_one_left_to_the_contract_check() -> None:
    subject = node_task_subject("image.cache_prewarm", "n1")
    assert "no node task type" in str(misrouted_task("n1", subject, {"type": "allocation.requested"}))
    for body in ({"payload": {}}, ["not", "an", "envelope"], {"type": 7}, object()):
        assert misrouted_task("n1", subject, body) is None
