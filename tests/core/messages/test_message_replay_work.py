"""What a replayed history costs, and the exact equivalents it stands on: a message the memory
holds is recognised node for node (``message_history.prove``) instead of validated and
fingerprinted, a replayed result's documents are read from its record, and a plain message's
fingerprint is computed only when something asks for it (docs/DESIGN.md, "Byte-stable
history", "Hot path")."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from contextpilot_integrations.core.messages import (
    MessagePlanner,
    documents,
    message_history,
    message_planner,
    pointers,
)
from contextpilot_integrations.core.messages.documents import find_text
from contextpilot_integrations.core.messages.message_history import (
    fingerprint,
    is_plain,
    same_tree,
)
from contextpilot_integrations.core.messages.pointers import POINTER_MARK, RequestView
from contextpilot_integrations.core.request import Scope

SCOPE = Scope(conversation_id="conv", tenant="acme")
WORDS = ["kv", "cache", "prefix", "radix", "tree", "engine", "token", "page", "block", "hit"]


def doc(n: int) -> str:
    rng = random.Random(n)
    return f"Document {n}. " + " ".join(rng.choice(WORDS) for _ in range(80))


def rounds(count: int) -> list[dict[str, Any]]:
    """An agent history: system, task, then ``count`` rounds of a search and its JSON result
    of three documents, the documents repeating across rounds."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Find out about KV caches."},
    ]
    for r in range(count):
        call_id = f"call_{r}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "search", "arguments": json.dumps({"q": f"part {r}"})},
                    }
                ],
            }
        )
        picked = [(r + k) % 5 for k in range(3)]
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": json.dumps([{"id": f"d{d}", "text": doc(d)} for d in picked]),
            }
        )
    return messages


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls = [0]
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# ------------------------------------------------------------------ work per call
def test_a_replayed_history_reads_only_its_new_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    planner = MessagePlanner()
    for count in range(1, 8):
        planner.plan(rounds(count), scope=SCOPE)  # as the app has them, each call one round more
    found = counting(monkeypatch, message_planner, "find_documents")
    validated = counting(monkeypatch, message_planner, "validate_message")
    hashed = counting(monkeypatch, message_planner, "fingerprint")
    plan = planner.plan(rounds(8), scope=SCOPE)
    assert plan.replayed == 16 and plan.pointers
    assert validated[0] == 2  # the new round's two messages
    assert found[0] <= 2  # the new result (and its text with pointers in it)
    assert hashed[0] == 0  # plain messages: no fingerprint is needed


def test_a_history_given_back_as_sent_is_recognised_too(monkeypatch: pytest.MonkeyPatch) -> None:
    planner = MessagePlanner()
    sent = planner.plan(rounds(6), scope=SCOPE).messages
    assert any(POINTER_MARK in (m.get("content") or "") for m in sent)
    validated = counting(monkeypatch, message_planner, "validate_message")
    plan = planner.plan(sent + rounds(7)[-2:], scope=SCOPE)
    assert plan.replayed == len(sent) and plan.messages[: len(sent)] == sent
    assert validated[0] == 2


# ------------------------------------------------------------------ what it stands on
def test_a_message_of_another_type_is_validated_and_fingerprinted_as_before() -> None:
    planner = MessagePlanner()
    messages = rounds(3)
    planner.plan(messages, scope=SCOPE)
    as_tuple = copy.deepcopy(messages)
    as_tuple[2]["tool_calls"] = tuple(as_tuple[2]["tool_calls"])  # same JSON, another type
    plan = planner.plan(as_tuple, scope=SCOPE)
    assert (plan.replayed, plan.diverged_at) == (len(messages), None)
    broken = copy.deepcopy(messages)
    broken[4]["tool_calls"] = ("not a call",)
    with pytest.raises(ValueError, match=r"messages\[4\]\.tool_calls\[0\] must be a dict"):
        planner.plan(broken, scope=SCOPE)
    cyclic = copy.deepcopy(messages)
    loop: list[Any] = []
    loop.append(loop)
    cyclic[3]["extra"] = loop
    with pytest.raises(ValueError, match=r"messages\[3\]\.extra\[0\] is a container"):
        planner.plan(cyclic, scope=SCOPE)


@pytest.mark.parametrize(
    "other",
    [1.0, True, "1", [1], None, {"k": 1}, 2],
)
def test_same_tree_is_as_strict_as_canonical_json(other: Any) -> None:
    plain = {"a": [1, {"k": "v"}], "b": None}
    value = copy.deepcopy(plain)
    value["a"][0] = other
    assert same_tree(value, plain) == (fingerprint(value) == fingerprint(plain))


def test_same_tree_ignores_key_order_and_reads_any_value_safely() -> None:
    plain = {"role": "tool", "tool_call_id": "c1", "content": "text"}
    assert same_tree(dict(reversed(list(plain.items()))), plain)
    assert not same_tree({**plain, "extra": 1}, plain)
    assert not same_tree({"role": "tool", "tool_call_id": "c1", "content": -0.0}, {"content": 0.0})
    loop: dict[str, Any] = {}
    loop["content"] = loop
    assert not same_tree(loop, {"content": {"content": "x"}})

    class Text(str):
        pass

    assert not same_tree({**plain, "content": Text("text")}, plain)


def test_plain_trees_have_a_fingerprint() -> None:
    assert is_plain({"a": [1, 2.5, True, None, "x"], "b": {"c": 10**17}})
    assert not is_plain({"a": 10**18})  # long ints are left to the full fingerprint
    assert not is_plain({"a": (1,)}) and not is_plain({1: "a"})


def test_every_pointer_starts_with_the_mark() -> None:
    for pointer in (
        pointers.result_pointer("f(x)"),
        pointers.document_pointer("f(x)", None),
        pointers.document_pointer("f(x)", '"id": "d1"'),
        documents.span_text("json", pointers.document_pointer("f(x)", '"id": "d1"')),
    ):
        assert pointer.startswith(POINTER_MARK)


def test_find_text_is_str_find() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        alphabet = rng.choice(["ab", "abc", "a"])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 160)))
        if text and rng.random() < 0.5:
            i = rng.randrange(len(text))
            needle = text[i : i + rng.randint(0, 90)] + rng.choice(["", "a", "b"])
        else:
            needle = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 70)))
        start = rng.randint(0, len(text) + 1)
        assert find_text(text, needle, start) == text.find(needle, start)


def test_a_view_built_on_an_earlier_one_is_the_view_built_afresh() -> None:
    planner = MessagePlanner()
    sent = planner.plan(rounds(5)).messages
    first = RequestView(rounds(5), "openai")
    again = RequestView(sent, "openai", first)
    fresh = RequestView(sent, "openai")
    for name in ("results", "by_position", "calls", "tool_calls", "by_signature"):
        assert getattr(again, name) == getattr(fresh, name)


def test_a_record_computes_a_fingerprint_it_was_not_given() -> None:
    planner = MessagePlanner()
    messages = rounds(3)
    planner.plan(messages, scope=SCOPE)
    records = planner._history.records(SCOPE.conversation)
    assert any(r.given is message_history.LATER for r in records)
    for record, message in zip(records, messages):
        assert record.given_fingerprint() == fingerprint(message)
        assert record.answers(fingerprint(message))
