"""Message shapes: every bad shape is a ValueError naming the field path and the value."""

from __future__ import annotations

from typing import Any

import pytest

from contextpilot_integrations.core.messages import MessagePlanner
from contextpilot_integrations.core.messages.message_shapes import MAX_DEPTH

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ("hello", "messages must be a list"),
        ([["user", "hi"]], r"messages\[0\] must be a message dict"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role .* 'robot'"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
            r"messages\[1\]\.content",
        ),
        ([{"role": "user", "content": [{"text": "a"}]}], r"messages\[0\]\.content\[0\]\.type"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\]\.text .* 3"),
        ([{"role": "tool", "content": "x"}], r"messages\[0\]\.tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], r"messages\[0\]\.tool_calls"),
        ([{"role": "assistant", "tool_calls": "c1"}], r"messages\[0\]\.tool_calls must be a list"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}],
                }
            ],
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments",
        ),
        ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], r"tool_calls\[0\]\.id"),
    ],
)
def test_bad_openai_shapes(messages: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MessagePlanner().plan(messages)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "system", "content": "x"}], r"messages\[0\]\.role .*system="),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        (
            [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}],
                }
            ],
            r"messages\[0\]\.content\[0\]\.input",
        ),
        (
            [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}],
            r"messages\[0\]\.content\[0\]\.tool_use_id",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": 7}],
                }
            ],
            r"messages\[0\]\.content\[0\]\.content",
        ),
    ],
)
def test_bad_anthropic_shapes(messages: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MessagePlanner().plan(messages, api="anthropic")


def test_bad_calls() -> None:
    planner = MessagePlanner()
    with pytest.raises(ValueError, match="api must be one of"):
        planner.plan([], api="gemini")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="system is only for api='anthropic'"):
        planner.plan([], system="x")
    with pytest.raises(ValueError, match=r"system\[0\]\.text"):
        planner.plan([], api="anthropic", system=[{"type": "text", "text": None}])
    with pytest.raises(ValueError, match="scope must be a Scope"):
        planner.plan([], scope="conv")  # type: ignore[arg-type]


def test_valid_odd_shapes_are_accepted() -> None:
    planner = MessagePlanner()
    openai: list[dict[str, Any]] = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "x", "type": "custom", "custom": {}}],
        },
        {"role": "assistant", "tool_calls": None, "refusal": "no"},
        {"role": "tool", "tool_call_id": "x", "content": [{"type": "file", "file": {"id": 1}}]},
    ]
    assert planner.plan(openai).messages == openai
    anthropic: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t", "is_error": True, "content": "boom"}
            ],
        },
    ]
    system = [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
    plan = planner.plan(anthropic, api="anthropic", system=system)
    assert plan.messages == anthropic and plan.system == system


def test_a_cycle_is_a_value_error_naming_its_path() -> None:
    part: dict[str, Any] = {"type": "text", "text": "x"}
    part["self"] = part
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.self .*a cycle"):
        MessagePlanner().plan([{"role": "user", "content": [part]}])
    message: dict[str, Any] = {"role": "user", "content": "x"}
    message["me"] = message
    with pytest.raises(ValueError, match=r"messages\[0\]\.me .*a cycle"):
        MessagePlanner().plan([message])
    items: list[Any] = []
    items.append(items)
    block = {"type": "tool_use", "id": "t", "name": "f", "input": {"q": items}}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.input\.q\[0\] .*a cycle"):
        MessagePlanner().plan([{"role": "assistant", "content": [block]}], api="anthropic")
    system: list[Any] = [{"type": "text", "text": "s"}]
    system[0]["again"] = system
    with pytest.raises(ValueError, match=r"system\[0\]\.again .*a cycle"):
        MessagePlanner().plan([{"role": "user", "content": "x"}], api="anthropic", system=system)


def test_a_value_shared_by_two_fields_is_no_cycle() -> None:
    shared = {"type": "text", "text": "same"}
    messages = [{"role": "user", "content": [shared, shared]}]
    assert MessagePlanner().plan(messages).messages == messages


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000])
def test_nesting_past_max_depth_is_a_value_error(depth: int) -> None:
    nested: dict[str, Any] = {}
    inner = nested
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]
    message = {"role": "user", "content": "x", "extra": nested}
    with pytest.raises(
        ValueError, match=rf"messages\[0\]\.extra(\.a)+ nests deeper than {MAX_DEPTH}"
    ):
        MessagePlanner().plan([message])


def test_nesting_up_to_max_depth_is_accepted() -> None:
    nested: dict[str, Any] = {}
    inner = nested
    for _ in range(MAX_DEPTH - 2):  # the message is depth 1, ``extra`` depth 2
        inner["a"] = {}
        inner = inner["a"]
    message = {"role": "user", "content": "x", "extra": nested}
    assert MessagePlanner().plan([message]).messages == [message]


def test_a_deep_non_message_is_named_without_recursing() -> None:
    deep: list[Any] = []
    inner = deep
    for _ in range(5_000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(ValueError, match=r"messages\[0\] must be a message dict, got list"):
        MessagePlanner().plan([deep])
