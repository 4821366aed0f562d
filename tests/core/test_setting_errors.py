"""Settings a new user got wrong get an error naming the field and the value (found by a
new-user trial: a str cache_sync failed with a dict() message, a negative visible turn was
accepted, a replica name's error did not show the value)."""

from __future__ import annotations

import pytest

from contextpilot_integrations import ContextPilot, ReplicaRouter, TurnVisibility


def test_cache_sync_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match=r"cache_sync must be a mapping.*'kv-events'"):
        ContextPilot(cache_sync="kv-events")  # type: ignore[arg-type]


@pytest.mark.parametrize("turn", [-1, -(2**40)])
def test_visible_turn_numbers_are_not_negative(turn: int) -> None:
    with pytest.raises(ValueError, match=rf"turns\[\.\.\.\] must be turn numbers >= 0, got {turn}"):
        TurnVisibility.only([turn])
    assert TurnVisibility.only([0, 3]).turns == frozenset({0, 3})  # scope.turn may be 0


def test_a_bad_replica_name_is_shown() -> None:
    with pytest.raises(ValueError, match="replica name must be .*, got 3"):
        ReplicaRouter([{"name": 3}])
