"""Mem0 filters -> tenant and conversation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextpilot_integrations.mem0.scope import MemoryScope, memory_scope


def test_entity_ids_make_the_tenant_and_run_id_the_conversation() -> None:
    assert memory_scope({"user_id": "alice"}) == MemoryScope("user_id=alice", None)
    assert memory_scope({"user_id": "alice", "agent_id": "a", "run_id": "r"}) == MemoryScope(
        "user_id=alice&agent_id=a&run_id=r", "r"
    )
    assert memory_scope({"run_id": "r"}, "chat") == MemoryScope("run_id=r", "chat")
    assert memory_scope(None) == MemoryScope("", None)


def test_ids_are_normalised_as_mem0_does_and_other_keys_ignored() -> None:
    assert memory_scope({"user_id": " alice ", "category": "food", "AND": []}) == memory_scope(
        {"user_id": "alice"}
    )
    assert memory_scope({"user_id": 42}) == memory_scope({"user_id": "42"})


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="filters"):
        memory_scope(["user_id"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="conversation_id"):
        memory_scope({"user_id": "a"}, 7)  # type: ignore[arg-type]


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
    assert (memory_scope(first).tenant == memory_scope(second).tenant) == same
