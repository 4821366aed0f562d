"""Settings a new user gets wrong get an error naming the field and the value: a negative
visible turn, a replica name, an ordering setting (a str engine link configuration:
tests/sync/test_engine_link.py)."""

from __future__ import annotations

import pytest

from contextpilot_integrations import ContextPilot, OrderingConfig, ReplicaRouter, TurnVisibility
from contextpilot_integrations.core.request import PlanRequest, Scope


@pytest.mark.parametrize("turn", [-1, -(2**40)])
def test_visible_turn_numbers_are_not_negative(turn: int) -> None:
    with pytest.raises(ValueError, match=rf"turns\[\.\.\.\] must be turn numbers >= 0, got {turn}"):
        TurnVisibility.only([turn])
    assert TurnVisibility.only([0, 3]).turns == frozenset({0, 3})  # scope.turn may be 0


def test_a_bad_replica_name_is_shown() -> None:
    with pytest.raises(ValueError, match="replica name must be .*, got 3"):
        ReplicaRouter([{"name": 3}])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"reorder": "never"}, r"reorder must be one of \('cost-aware', 'always'\), got 'never'"),
        ({"rest_order": "random"}, r"rest_order must be one of .*, got 'random'"),
        ({"build_method": "kmeans"}, r"build_method must be one of .*, got 'kmeans'"),
        ({"schedule_method": "fifo"}, r"schedule_method must be one of .*, got 'fifo'"),
        ({"alpha": -1.0}, r"alpha must be a finite number >= 0, got -1.0"),
        ({"alpha": float("nan")}, r"alpha must be a finite number >= 0, got nan"),
        ({"cluster_limit": 0}, r"cluster_limit must be an int >= 1, got 0"),
        ({"popularity_memory": -1}, r"popularity_memory must be an int >= 0, got -1"),
        ({"cooccurrence_memory": 2.5}, r"cooccurrence_memory must be an int >= 0, got 2.5"),
    ],
)
def test_a_bad_ordering_setting_is_named(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OrderingConfig(**settings)


def test_ordering_is_an_ordering_config() -> None:
    with pytest.raises(TypeError, match="ordering must be an OrderingConfig"):
        ContextPilot(ordering={"reorder": "always"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="weight_by_tokens must be a bool"):
        OrderingConfig(weight_by_tokens=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["a\r\nx-forged: 1", "nul\x00", "tab\tid", "del\x7f", "c1\x85"])
@pytest.mark.parametrize("field", ["rid", "conversation_id", "tenant"])
def test_ids_with_control_characters_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValueError, match="must not contain control characters"):
        if field == "rid":
            PlanRequest(query="q", blocks=["a block"], rid=value)
        else:
            Scope(**{field: value})
    assert Scope(conversation_id="c-1 ü", tenant="acme/β").conversation == ("acme/β", "c-1 ü")
