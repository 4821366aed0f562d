"""Warm start: a pilot learns its ordering memories from past requests without indexing them."""

from __future__ import annotations

import pytest

from contextpilot_integrations.core.ordering.ordering_config import OrderingConfig
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.request import PlanRequest, Scope

A, B, C, X = ("block A " * 12, "block B " * 12, "block C " * 12, "block X " * 12)


def _texts(plan) -> list[str]:  # type: ignore[no-untyped-def]
    return [block.text for block in plan.blocks]


def test_past_requests_order_new_ones_and_are_not_indexed() -> None:
    always = OrderingConfig(reorder="always")
    warm, cold = ContextPilot(ordering=always), ContextPilot(ordering=always)
    past = [
        PlanRequest(f"q{i}", [A, C, f"unique {i} " * 12], scope=Scope("c", turn=i))
        for i in range(6)
    ]
    assert warm.warm_start(past) == 6
    assert len(warm.index) == 0 and warm.stats()["totals"]["plans"] == 0
    plan = warm.plan("new", [X, C, A])
    assert _texts(plan)[:2] == [C, A]  # what past traffic held together leads
    assert plan.matched_prefix_tokens == 0  # nothing learned counts as cached
    assert _texts(cold.plan("new", [X, C, A])) == [X, C, A]


def test_empty_requests_teach_nothing() -> None:
    pilot = ContextPilot()
    assert pilot.warm_start([]) == 0
    assert pilot.warm_start([PlanRequest("q", []), PlanRequest("q", ["   "])]) == 0


def test_bad_input_names_the_field() -> None:
    pilot = ContextPilot()
    with pytest.raises(TypeError, match="requests must be a sequence of PlanRequest"):
        pilot.warm_start("not requests")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"requests\[1\] must be a PlanRequest.*dict"):
        pilot.warm_start([PlanRequest("q", [A]), {"query": "q"}])  # type: ignore[list-item]
    assert pilot.warm_start([PlanRequest("q", [A])]) == 1  # a refused call learned nothing
