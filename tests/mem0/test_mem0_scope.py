"""Mem0 filters -> the core's Scope (tenant and conversation)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextpilot_integrations.core.conversations.turns import TurnVisibility
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.mem0.scope import scope_from_filters


def test_entity_ids_make_the_tenant_and_run_id_the_conversation() -> None:
    assert scope_from_filters({"user_id": "alice"}) == Scope(None, "user_id=alice")
    assert scope_from_filters({"user_id": "alice", "agent_id": "a", "run_id": "r"}) == Scope(
        "r", "user_id=alice&agent_id=a&run_id=r"
    )
    assert scope_from_filters({"run_id": "r"}, "chat") == Scope("chat", "run_id=r")
    assert scope_from_filters(None) == Scope(None, "")


def test_turn_and_visibility_need_a_conversation() -> None:
    last = TurnVisibility.last(1)
    assert scope_from_filters({"run_id": "r"}, turn=3, visibility=last) == Scope(
        "r", "run_id=r", 3, last
    )
    # Without a conversation nothing is de-duplicated: a visibility has nothing to hide.
    assert scope_from_filters({"user_id": "alice"}, visibility=last) == Scope(None, "user_id=alice")
    with pytest.raises(ValueError, match="turn=3 needs a scope.conversation_id"):
        scope_from_filters({"user_id": "alice"}, turn=3)


def test_ids_are_normalised_as_mem0_does_and_other_keys_ignored() -> None:
    assert scope_from_filters(
        {"user_id": " alice ", "category": "food", "AND": []}
    ) == scope_from_filters({"user_id": "alice"})
    assert scope_from_filters({"user_id": 42}) == scope_from_filters({"user_id": "42"})


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="filters"):
        scope_from_filters(["user_id"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="conversation_id"):
        scope_from_filters({"user_id": "a"}, 7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="turn"):
        scope_from_filters({"run_id": "r"}, turn="1")  # type: ignore[arg-type]


ids = st.none() | st.text(alphabet="ab&=% ", min_size=1, max_size=4)


@given(ids, ids, ids, ids, ids, ids)
def test_different_entity_ids_never_share_a_tenant(
    user: str | None,
    agent: str | None,
    run: str | None,
    user2: str | None,
    agent2: str | None,
    run2: str | None,
) -> None:
    def norm(value: str | None) -> str | None:
        return value.strip() or None if value is not None else None

    first = {"user_id": user, "agent_id": agent, "run_id": run}
    second = {"user_id": user2, "agent_id": agent2, "run_id": run2}
    same = all(norm(first[k]) == norm(second[k]) for k in first)
    assert (scope_from_filters(first).tenant == scope_from_filters(second).tenant) == same
