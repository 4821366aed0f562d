"""Planning over messages, rule by rule, in both shapes (the rules: message_planner's docstring)."""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import replace
from typing import Any

import pytest

from contextpilot_integrations.core.messages import MessagePlanner, message_planner
from contextpilot_integrations.core.messages.message_history import text_size
from contextpilot_integrations.core.messages.pointers import (
    MIN_SHOWN,
    RequestView,
    check_pointer,
    named_by,
    named_signatures,
    short_name,
)
from contextpilot_integrations.core.messages.repeated_lines import check_run_placement
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import Scope

LONG = "The KV cache keeps the keys and values of every token already seen. " * 6
OTHER = "Prefix caching reuses the KV of the longest byte-identical prefix. " * 6
THIRD = "A radix tree indexes the cached prefixes of all running requests. " * 6
SCOPE = Scope(conversation_id="conv", tenant="acme")


def call(call_id: str, name: str = "search", **arguments: Any) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def assistant(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def tool(call_id: str, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def history(first: str, second: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "What is a KV cache?"},
        assistant(call("c1", query="kv cache")),
        tool("c1", first),
        assistant(call("c2", query="kv caching")),
        tool("c2", second),
    ]


# ------------------------------------------------------------------ same result
def test_a_repeated_result_becomes_a_pointer_naming_the_earlier_call() -> None:
    messages = history(LONG, "\n" + LONG + "  ")
    plan = MessagePlanner().plan(messages)
    assert plan.messages[:5] == messages[:5]
    assert plan.messages[5]["content"] == '[Same result as search({"query": "kv cache"}) above.]'
    pointer = plan.placements[-1]
    assert pointer.status == "pointer" and pointer.reason == "same result"
    assert (pointer.message, pointer.target_message, pointer.target_call) == (
        5,
        3,
        'search({"query": "kv cache"})',
    )
    assert pointer.original == messages[5]["content"] and pointer.tokens_saved > 16
    assert plan.tokens_removed == pointer.tokens_saved


def test_a_pointer_that_saves_too_little_is_not_made() -> None:
    short = (
        "Output that repeats, but is only a little longer than the pointer that could replace it."
    )
    plan = MessagePlanner().plan(history(short, short))
    assert plan.messages[5]["content"] == short
    assert plan.placements[-1].reason == "saves too little"
    assert MessagePlanner(min_tokens_saved=0).plan(history(short, short)).pointers


def test_a_call_that_read_two_ways_is_not_named() -> None:
    messages = history(LONG, OTHER)
    messages[4] = assistant(call("c2", query="kv cache"))  # same call, another result
    messages += [assistant(call("c3", query="x")), tool("c3", LONG)]
    plan = MessagePlanner().plan(messages)
    assert plan.messages[7]["content"] == LONG
    assert plan.placements[-1].reason == "ambiguous call"


def test_the_same_call_twice_with_the_same_result_is_not_ambiguous() -> None:
    messages = history(LONG, LONG)
    messages[4] = assistant(call("c2", query="kv cache"))
    messages += [assistant(call("c3", query="kv cache")), tool("c3", LONG)]
    plan = MessagePlanner().plan(messages)
    assert [p.status for p in plan.placements] == ["kept", "pointer", "pointer"]


def test_only_tool_results_are_rewritten_and_only_tool_results_are_pointed_at() -> None:
    messages = [
        {"role": "user", "content": LONG},
        assistant(call("c1", query="q")),
        tool("c1", LONG),  # equals a user message: not a tool result, not a target
        {"role": "assistant", "content": LONG},  # the model's own text is never rewritten
        {"role": "user", "content": LONG},
    ]
    plan = MessagePlanner().plan(messages)
    assert plan.messages == messages and not plan.pointers


def test_a_result_without_its_call_is_never_a_target() -> None:
    messages = [tool("orphan", LONG), assistant(call("c1", query="q")), tool("c1", LONG)]
    plan = MessagePlanner().plan(messages)
    assert plan.messages == messages and not plan.pointers


def test_parallel_calls_point_at_an_earlier_result_of_the_same_turn() -> None:
    messages = [
        {"role": "user", "content": "go"},
        assistant(call("a", query="one"), call("b", query="two")),
        tool("a", LONG),
        tool("b", LONG),
    ]
    plan = MessagePlanner().plan(messages)
    assert plan.messages[3]["content"].startswith('[Same result as search({"query": "one"})')


# ------------------------------------------------------------------ anthropic
def anthropic_history(first: Any, second: Any) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "What is a KV cache?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Searching."},
                {"type": "tool_use", "id": "t1", "name": "search", "input": {"query": "kv"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": first}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t2", "name": "search", "input": {"query": "ké"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t2", "content": second},
                {"type": "text", "text": "Please answer."},
            ],
        },
    ]


def test_anthropic_tool_results_keep_their_shape() -> None:
    messages = anthropic_history(LONG, [{"type": "text", "text": LONG}])
    plan = MessagePlanner().plan(messages, api="anthropic", system="Be brief.")
    assert plan.system == "Be brief."
    block = plan.messages[4]["content"][0]
    assert block["content"] == [
        {"type": "text", "text": '[Same result as search({"query": "kv"}) above.]'}
    ]
    assert plan.messages[4]["content"][1] == messages[4]["content"][1]
    assert plan.messages[:4] == messages[:4]
    pointer = plan.pointers[0]
    assert (pointer.message, pointer.block, pointer.target_message, pointer.target_block) == (
        4,
        0,
        2,
        0,
    )


def test_anthropic_input_is_named_as_json() -> None:
    messages = anthropic_history(LONG, LONG)
    messages += [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t3", "name": "fetch", "input": {"q": 1}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t3", "content": OTHER}],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t4", "name": "fetch", "input": {"q": 2}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t4", "content": OTHER}],
        },
    ]
    plan = MessagePlanner().plan(messages, api="anthropic")
    assert plan.messages[8]["content"][0]["content"] == '[Same result as fetch({"q": 1}) above.]'


# ------------------------------------------------------------------ documents
def numbered(*docs: str) -> str:
    return "Results:\n\n" + "\n\n".join(f"[{n}] {d}" for n, d in enumerate(docs, 1)) + "\n"


def test_a_repeated_numbered_document_is_replaced_in_place() -> None:
    first, second = numbered(LONG, OTHER), numbered(THIRD, OTHER.strip())
    plan = MessagePlanner().plan(history(first, second))
    sent = plan.messages[5]["content"]
    pointer = '[Same as document [2] of search({"query": "kv cache"}) above.]'
    assert sent == second.replace(OTHER.strip(), pointer)
    placement = [p for p in plan.pointers if p.document is not None][0]
    assert (placement.document, placement.label, placement.target_document) == (1, "[2]", 1)
    assert sent[placement.offset :].startswith(placement.pointer)
    kept = [p for p in plan.placements if p.message == 5 and p.status == "kept"]
    assert {p.document for p in kept} == {None, 0}  # the result itself and its first document


def test_a_repeated_tagged_document_is_replaced_in_place() -> None:
    def tagged(*docs: str) -> str:
        return "".join(
            f'<document index="{n}" source="s{n}">\n{d}\n</document>\n' for n, d in enumerate(docs)
        )

    plan = MessagePlanner().plan(history(tagged(LONG, OTHER), tagged(OTHER, THIRD)))
    sent = plan.messages[5]["content"]
    assert sent.startswith('<document index="0" source="s0">\n[Same as document index="1" of ')
    assert sent.endswith(f"{THIRD}\n</document>\n")


def test_a_repeated_json_document_is_replaced_and_the_result_stays_json() -> None:
    first = json.dumps({"results": [{"id": "d1", "text": LONG}, {"id": "d2", "text": OTHER}]})
    second = json.dumps([{"id": "d9", "text": THIRD}, {"id": "d2", "text": OTHER, "score": 0.5}])
    plan = MessagePlanner().plan(history(first, second))
    sent = json.loads(plan.messages[5]["content"])
    assert sent[0] == {"id": "d9", "text": THIRD}
    assert sent[1]["text"] == '[Same as document id "d2" of search({"query": "kv cache"}) above.]'
    assert sent[1]["score"] == 0.5


def rendered(*docs: str, order: tuple[int, ...] = ()) -> str:
    """Documents as the library's renderer lays them out (``[Doc n]`` blocks, then the tail)."""
    layout = PromptLayout()
    blocks = "".join(layout.render_block(i, d) for i, d in enumerate(docs))
    return blocks + layout.context_tail(annotation_labels=[layout.label(i) for i in order])


def test_a_repeated_rendered_document_is_replaced_in_place_and_named_by_its_label() -> None:
    first = rendered(LONG, OTHER, order=(1, 0))
    second = rendered(THIRD, OTHER, LONG, order=(2, 0, 1))
    plan = MessagePlanner().plan(history(first, second))
    sent = plan.messages[5]["content"]
    call = 'search({"query": "kv cache"})'
    expected = second.replace(
        OTHER.strip(), f"[Same as document [Doc 2] of {call} above.]"
    ).replace(LONG.strip(), f"[Same as document [Doc 1] of {call} above.]")
    assert sent == expected  # every other byte: labels, separators, the order annotation
    assert sent.endswith(
        "-----\nRead the documents in this priority order: [Doc 3] > [Doc 1] > [Doc 2].\n"
    )
    placed = sorted(
        (p.document, p.label, p.target_document, p.target_label, p.reason)
        for p in plan.placements
        if p.message == 5 and p.document is not None
    )
    assert placed == [
        (0, "[Doc 1]", None, None, "no earlier copy"),
        (1, "[Doc 2]", 1, "[Doc 2]", "same document"),
        (2, "[Doc 3]", 0, "[Doc 1]", "same document"),
    ]
    for pointer in plan.pointers:
        assert sent[pointer.offset :].startswith(pointer.pointer)


def test_a_rendered_result_whose_text_holds_a_label_line_is_not_split() -> None:
    nested = f"{LONG}\n[Doc 2]\nnot a label"
    plan = MessagePlanner().plan(history(rendered(OTHER, THIRD), rendered(nested, THIRD)))
    # no document of it is named; only the lines it repeats may stand as a run of lines
    assert all(p.reason == "same lines" for p in plan.pointers)
    assert not [p for p in plan.placements if p.message == 5 and p.label is not None]
    sent = plan.messages[5]["content"]
    for p in sorted(plan.pointers, key=lambda p: -(p.offset or 0)):
        assert p.offset is not None and p.pointer is not None and p.original is not None
        sent = sent[: p.offset] + p.original + sent[p.offset + len(p.pointer) :]
    assert sent == rendered(nested, THIRD)


def test_a_json_document_without_a_label_is_not_pointed_at() -> None:
    first = json.dumps([{"text": LONG}, {"text": OTHER}])
    second = json.dumps([{"text": THIRD}, {"text": OTHER}])
    plan = MessagePlanner().plan(history(first, second))
    assert plan.messages[5]["content"] == second
    assert [p.reason for p in plan.placements if p.message == 5 and p.document == 1] == [
        "no earlier copy"
    ]


def test_a_document_equal_to_a_whole_earlier_result_names_that_result() -> None:
    plan = MessagePlanner().plan(history(OTHER, numbered(THIRD, OTHER)))
    assert "[2] [Same as the result of search(" in plan.messages[5]["content"]
    assert plan.pointers[0].target_label is None


def test_a_document_whose_label_repeats_in_the_earlier_result_is_kept() -> None:
    first = numbered(LONG, OTHER) + "\n[2] is cited twice\n"
    plan = MessagePlanner().plan(history(first, numbered(THIRD, OTHER)))
    # no pointer names the label "[2]", which names two lines there; the repeated line may
    # still stand as a line pointer, which quotes the line's start
    assert not [p for p in plan.pointers if p.reason != "same lines"]
    assert all(p.target_label is None for p in plan.pointers)
    view = RequestView(plan.messages, "openai")
    assert all(check_run_placement(view, p) for p in plan.pointers)


# ------------------------------------------------------------------ byte-stable history
def test_an_extended_history_is_replayed_byte_for_byte() -> None:
    planner = MessagePlanner()
    messages = history(LONG, LONG)
    first = planner.plan(messages, scope=SCOPE)
    later = messages + [{"role": "user", "content": "and then?"}]
    second = planner.plan(later, scope=SCOPE)
    assert (second.replayed, second.diverged_at) == (6, None)
    assert json.dumps(second.messages[:6]) == json.dumps(first.messages)
    assert [p.replayed for p in second.placements] == [True, True]
    assert second.tokens_removed == first.tokens_removed


def test_an_app_that_sends_back_what_was_sent_is_replayed() -> None:
    planner = MessagePlanner()
    first = planner.plan(history(LONG, LONG), scope=SCOPE)
    second = planner.plan(first.messages + [{"role": "user", "content": "more"}], scope=SCOPE)
    assert second.replayed == 6 and second.messages[:6] == first.messages


def test_an_edited_message_diverges_and_its_pointers_go() -> None:
    planner = MessagePlanner()
    messages = history(LONG, LONG)
    assert planner.plan(messages, scope=SCOPE).pointers
    edited = copy.deepcopy(messages)
    edited[3]["content"] = "summarised: " + LONG[:40]
    plan = planner.plan(edited, scope=SCOPE)
    assert (plan.replayed, plan.diverged_at) == (3, 3)
    assert plan.messages == edited and not plan.pointers  # no pointer to the text edited away


def test_a_trimmed_or_shortened_history_diverges() -> None:
    planner = MessagePlanner()
    messages = history(LONG, OTHER)
    planner.plan(messages, scope=SCOPE)
    trimmed = planner.plan([messages[0]] + messages[2:], scope=SCOPE)
    assert (trimmed.replayed, trimmed.diverged_at) == (1, 1)
    shorter = planner.plan(messages[:4], scope=SCOPE)  # against the trimmed history now
    assert (shorter.replayed, shorter.diverged_at) == (1, 1)
    planner.plan(messages, scope=SCOPE)
    retried = planner.plan(messages[:4], scope=SCOPE)
    assert (retried.replayed, retried.diverged_at) == (4, 4)


POINTER = '[Same result as search({"query": "kv cache"}) above.]'


def dangling(messages: list[dict[str, Any]], plan: Any) -> list[int]:
    """The messages holding a pointer text that no checked pointer of ``plan`` accounts for."""
    view = RequestView(plan.messages, "openai")
    held = {p.message for p in plan.pointers if check_pointer(view, p)}
    return [
        i
        for i, m in enumerate(plan.messages)
        if "[Same " in json.dumps(m) and i not in held and "[Same " not in json.dumps(messages[i])
    ]


def test_a_history_given_back_as_sent_then_trimmed_gets_its_originals_back() -> None:
    planner = MessagePlanner()
    messages = history(LONG, LONG)
    sent = planner.plan(messages, scope=SCOPE).messages
    assert sent[5]["content"] == POINTER
    # the app keeps what was sent, then trims the call the pointer names
    trimmed = sent[:2] + sent[4:] + [{"role": "user", "content": "more"}]
    plan = planner.plan(trimmed, scope=SCOPE)
    assert (plan.replayed, plan.diverged_at) == (2, 2)
    assert plan.messages[3] == messages[5]  # the app's original, not a dangling pointer
    assert not plan.pointers and not any("[Same " in json.dumps(m) for m in plan.messages)
    # what went out is remembered: sent back again, it replays
    again = planner.plan(plan.messages + [{"role": "user", "content": "go"}], scope=SCOPE)
    assert again.replayed == 5 and again.messages[:5] == plan.messages


def test_a_history_given_back_as_sent_then_edited_keeps_only_pointers_that_hold() -> None:
    planner = MessagePlanner()
    messages = history(LONG, LONG)
    messages += [assistant(call("c3", query="kv cache")), tool("c3", LONG)]
    sent = planner.plan(messages, scope=SCOPE).messages
    assert [m["content"] for m in sent[5::2]] == [POINTER, POINTER]
    edited = copy.deepcopy(sent)
    edited[3]["content"] = "summarised"  # the text both pointers stand for is gone
    plan = planner.plan(edited, scope=SCOPE)
    assert (plan.replayed, plan.diverged_at) == (3, 3)
    assert plan.messages[5]["content"] == LONG  # restored, then the first copy standing
    assert plan.messages[7]["content"] == POINTER.replace("kv cache", "kv caching")
    assert [p.target_message for p in plan.pointers] == [5]
    assert dangling(edited, plan) == []


def test_a_document_pointer_given_back_as_sent_then_trimmed_is_restored_byte_for_byte() -> None:
    planner = MessagePlanner()
    first = json.dumps({"results": [{"id": 1, "text": LONG}, {"id": 2, "text": OTHER}]})
    second = json.dumps([{"id": 9, "text": THIRD}, {"id": 2, "text": OTHER}], indent=1)
    sent = planner.plan(history(first, second), scope=SCOPE).messages
    assert "[Same as document id 2 of " in sent[5]["content"]
    plan = planner.plan(sent[:2] + sent[4:], scope=SCOPE)
    assert plan.messages[3]["content"] == second and not plan.pointers


def test_an_anthropic_history_given_back_as_sent_then_trimmed_gets_its_originals_back() -> None:
    planner = MessagePlanner()
    messages = anthropic_history(LONG, [{"type": "text", "text": LONG}])
    sent = planner.plan(messages, scope=SCOPE, api="anthropic").messages
    assert "[Same result" in json.dumps(sent[4])
    plan = planner.plan(sent[:1] + sent[3:], scope=SCOPE, api="anthropic")
    assert plan.messages == messages[:1] + messages[3:] and not plan.pointers


def test_a_replayed_pointer_that_fails_its_check_is_a_divergence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    planner = MessagePlanner()
    messages = history(LONG, LONG)
    sent = planner.plan(messages, scope=SCOPE).messages
    more = [{"role": "user", "content": "more"}]
    real = message_planner.check_pointer
    monkeypatch.setattr(
        message_planner, "check_pointer", lambda view, p: not p.replayed and real(view, p)
    )
    plan = planner.plan(sent + more, scope=SCOPE)  # given as sent: the pointer itself
    assert (plan.replayed, plan.diverged_at) == (5, 5)
    assert [(p.message, p.replayed) for p in plan.pointers] == [(5, False)]  # made anew
    monkeypatch.setattr(message_planner, "check_pointer", lambda view, p: False)
    plan = planner.plan(sent + more, scope=SCOPE)
    assert (plan.replayed, plan.diverged_at) == (5, 5)
    assert plan.messages == messages + more  # the app's original, no pointer


def test_a_history_given_as_sent_to_a_planner_without_its_memory_is_the_apps_text() -> None:
    sent = MessagePlanner().plan(history(LONG, LONG), scope=SCOPE).messages
    plan = MessagePlanner().plan(sent[:2] + sent[4:])
    assert plan.messages == sent[:2] + sent[4:] and not plan.pointers


def test_no_scope_means_no_memory() -> None:
    planner = MessagePlanner()
    messages = history(LONG, LONG)
    for scope in (None, Scope(tenant="acme")):
        planner.plan(messages, scope=scope)
        plan = planner.plan(messages, scope=scope)
        assert (plan.replayed, plan.diverged_at) == (0, None)
    assert planner.conversations == 0


def test_tenants_and_conversations_do_not_share_memory() -> None:
    planner = MessagePlanner()
    messages = history(LONG, LONG)
    planner.plan(messages, scope=SCOPE)
    for scope in (Scope(conversation_id="conv", tenant="other"), Scope(conversation_id="c2")):
        assert planner.plan(messages, scope=scope).replayed == 0
    assert planner.plan(messages, scope=SCOPE).replayed == 6


def test_forget_and_eviction_replay_nothing() -> None:
    planner = MessagePlanner(max_conversations=1)
    messages = history(LONG, LONG)
    planner.plan(messages, scope=SCOPE)
    assert planner.forget(SCOPE) and not planner.forget(SCOPE)
    assert planner.plan(messages, scope=SCOPE).replayed == 0
    planner.plan(messages, scope=Scope(conversation_id="other"))  # evicts SCOPE's
    assert planner.plan(messages, scope=SCOPE).replayed == 0


def test_the_memory_keeps_at_most_max_chars_of_messages_least_recent_dropped_first() -> None:
    messages = history(LONG, LONG)
    one = text_size(MessagePlanner().plan(messages).messages)
    planner = MessagePlanner(max_chars=2 * one + one // 2)  # room for two conversations
    scopes = [Scope(conversation_id=f"c{i}") for i in range(3)]
    for scope in scopes:
        planner.plan(messages, scope=scope)
    assert planner.conversations == 2
    assert planner.plan(messages, scope=scopes[0]).replayed == 0  # the oldest went
    assert planner.plan(messages, scope=scopes[2]).replayed == len(messages)
    alone = MessagePlanner(max_chars=1)  # a conversation over the bound is kept alone
    alone.plan(messages, scope=SCOPE)
    assert alone.plan(messages, scope=SCOPE).replayed == len(messages)


def test_messages_past_the_cap_are_planned_again_the_same_way() -> None:
    planner = MessagePlanner(max_messages=4)
    messages = history(LONG, LONG)
    first = planner.plan(messages, scope=SCOPE)
    second = planner.plan(messages, scope=SCOPE)
    assert second.replayed == 4 and second.messages == first.messages


# ------------------------------------------------------------------ sure hints
def test_a_pointer_that_fails_its_check_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(message_planner, "check_pointer", lambda view, placement: False)
    messages = history(numbered(LONG, OTHER), LONG)
    messages += [assistant(call("c3", query="z")), tool("c3", numbered(THIRD, OTHER))]
    plan = MessagePlanner().plan(messages)
    assert plan.messages == messages and not plan.pointers and plan.tokens_removed == 0
    assert {p.reason for p in plan.placements if p.message in (5, 7)} >= {"not verified"}


def test_the_check_reads_the_messages_it_is_given() -> None:
    plan = MessagePlanner().plan(history(LONG, LONG))
    pointer = plan.pointers[0]
    assert check_pointer(RequestView(plan.messages, "openai"), pointer)
    moved = copy.deepcopy(plan.messages)
    moved[3]["content"] = LONG[:-5]
    assert not check_pointer(RequestView(moved, "openai"), pointer)
    renamed = copy.deepcopy(plan.messages)
    renamed[2]["tool_calls"][0]["function"]["arguments"] = '{"query": "other"}'
    assert not check_pointer(RequestView(renamed, "openai"), pointer)


# ------------------------------------------------------------------ short names
QUESTION = "Who founded the company that makes the engine behind the KV cache of this server?"
RIVAL = "Who founded the company that makes the radix tree used by this server?"


def question_history(*queries: str) -> list[dict[str, Any]]:
    """A question, a search per query (results LONG, then OTHER for every later query), and a
    last search of the first query again, returning LONG."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Who founded it?"}]
    for n, query in enumerate(queries):
        messages += [assistant(call(f"q{n}", query=query)), tool(f"q{n}", OTHER if n else LONG)]
    return messages + [assistant(call("again", query=queries[0])), tool("again", LONG)]


def test_a_long_call_is_named_by_the_shortest_prefix_of_its_arguments() -> None:
    messages = question_history(QUESTION, "kv cache")
    plan = MessagePlanner().plan(messages)
    name = 'search({"query": "Who founded the company\u2026)'  # MIN_SHOWN, to a word's end
    assert plan.messages[-1]["content"] == f"[Same result as {name} above.]"
    pointer = plan.pointers[0]
    assert (pointer.target_message, pointer.target_call) == (2, name)
    assert json.dumps(QUESTION).startswith(name[len('search({"query": ') : -2])
    assert MessagePlanner().plan(messages) == plan  # deterministic
    assert check_pointer(RequestView(plan.messages, "openai"), pointer)


def test_a_prefix_shared_with_a_call_of_another_result_is_made_longer() -> None:
    plan = MessagePlanner().plan(question_history(QUESTION, RIVAL))
    name = 'search({"query": "Who founded the company that makes the engine\u2026)'
    assert plan.messages[-1]["content"] == f"[Same result as {name} above.]"
    assert not RIVAL.startswith(name[len('search({"query": "') : -2])


def test_a_call_with_no_unique_prefix_shorter_than_itself_is_named_whole() -> None:
    # The rival's arguments start with all of the question's but its closing brace.
    messages = question_history(QUESTION)
    messages[1:1] = [
        assistant(call("r", query=QUESTION, k=5)),
        tool("r", OTHER),
    ]
    plan = MessagePlanner().plan(messages)
    whole = f"search({json.dumps({'query': QUESTION})})"
    assert plan.messages[-1]["content"] == f"[Same result as {whole} above.]"


def test_a_short_call_is_named_whole_where_a_cut_saves_too_little() -> None:
    signature = 'search({"query": "kv cache prefix reuse ratio"})'
    assert short_name(signature, []) is not None  # a cut exists, one character shorter
    plan = MessagePlanner().plan(question_history("kv cache prefix reuse ratio"))
    assert plan.pointers[0].target_call == signature


def test_a_document_pointer_names_the_call_by_its_prefix_too() -> None:
    messages = question_history(QUESTION, RIVAL)
    messages[2] = tool("q0", numbered(LONG, THIRD))
    messages[-1] = tool("again", numbered(OTHER + " new", THIRD))
    plan = MessagePlanner().plan(messages)
    name = 'search({"query": "Who founded the company that makes the engine\u2026)'
    pointer = f"[2] [Same as document [2] of {name} above.]"
    assert pointer in plan.messages[-1]["content"]
    final = RequestView(plan.messages, "openai")
    assert all(check_pointer(final, p) for p in plan.pointers)


def test_the_check_refuses_a_prefix_that_names_two_readings() -> None:
    messages = question_history(QUESTION, "kv cache")
    plan = MessagePlanner().plan(messages)
    pointer = plan.pointers[0]
    assert pointer.target_call is not None and pointer.target_call.endswith("\u2026)")
    # An earlier call whose arguments start with the same prefix, with another result.
    added = [assistant(call("r", query=RIVAL)), tool("r", THIRD)]
    sent = plan.messages[:3] + added + plan.messages[3:]
    moved = replace(pointer, message=pointer.message + 2)
    assert not check_pointer(RequestView(sent, "openai"), moved)
    # The same call with the same result does not make it ambiguous.
    same = [assistant(call("r", query=RIVAL)), tool("r", LONG)]
    assert check_pointer(RequestView(plan.messages[:3] + same + plan.messages[3:], "openai"), moved)
    # A name that stands for another call than the one the result answers fails.
    other = replace(pointer, target_call='search({"query": "Who founded the firm\u2026)')
    assert not check_pointer(RequestView(plan.messages, "openai"), other)


def test_a_replayed_short_name_holds_when_a_later_call_shares_its_prefix() -> None:
    planner = MessagePlanner()
    messages = question_history(QUESTION, "kv cache")
    first = planner.plan(messages, scope=SCOPE)
    later = messages + [assistant(call("r", query=RIVAL)), tool("r", THIRD)]
    second = planner.plan(later, scope=SCOPE)
    assert second.replayed == len(messages) and second.diverged_at is None
    assert second.messages[: len(messages)] == first.messages


def test_short_names_and_what_they_stand_for() -> None:
    signature = f"search({json.dumps({'query': QUESTION})})"
    rival = f"search({json.dumps({'query': RIVAL})})"
    assert short_name(signature, []) == 'search({"query": "Who founded the company\u2026)'
    assert short_name(signature, sorted([signature, rival])) == (
        'search({"query": "Who founded the company that makes the engine\u2026)'
    )
    assert short_name('search({"query": "kv"})', []) is None  # not shorter than itself
    name = short_name(signature, [])
    assert name is not None and len(name) - len("search(") - 2 >= MIN_SHOWN
    assert named_by(name, signature) and named_by(name, rival)  # the check reads it so
    assert not named_by(name, 'search({"query": "Who founded the firm?"})')
    assert named_by(signature, signature) and not named_by(signature, rival)
    assert named_signatures(name, sorted([rival, signature, 'fetch({"q": 1})'])) == sorted(
        [rival, signature]
    )


# ------------------------------------------------------------------ the rest
def test_the_input_is_never_changed() -> None:
    messages = history(numbered(LONG, OTHER), numbered(OTHER, LONG))
    before = copy.deepcopy(messages)
    plan = MessagePlanner().plan(messages, scope=SCOPE)
    assert messages == before
    plan.messages[5]["content"] = "changed by the caller"
    assert MessagePlanner().plan(messages).messages[5]["content"] != "changed by the caller"


def test_odd_but_valid_content_passes_through() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "look"}, image]},
        assistant(call("c1", query="q")),
        tool("c1", [image]),
        tool("c1", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
        tool("c1", "lone \ud800 surrogate " + LONG),
        {"role": "developer", "content": "be terse", "name": "x", "extra": {"k": [1]}},
    ]
    plan = MessagePlanner().plan(messages, scope=SCOPE)
    assert plan.messages == messages
    assert [p.reason for p in plan.placements] == ["not plain text"] * 3


def test_same_inputs_give_the_same_plan() -> None:
    messages = history(numbered(LONG, OTHER), numbered(THIRD, LONG))
    assert MessagePlanner().plan(messages, scope=SCOPE) == MessagePlanner().plan(
        messages, scope=SCOPE
    )


def test_concurrent_calls_of_many_conversations() -> None:
    planner = MessagePlanner()
    messages = history(numbered(LONG, OTHER), numbered(THIRD, LONG))
    expected = MessagePlanner().plan(messages).messages
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for turn in range(20):
                scope = Scope(conversation_id=f"c{n}")
                plan = planner.plan(messages, scope=scope)
                assert plan.messages == expected and plan.replayed == (6 if turn else 0)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and planner.conversations == 8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_tokens_saved": -1}, "min_tokens_saved"),
        ({"max_conversations": 0}, "max_conversations"),
        ({"max_messages": True}, "max_messages"),
        ({"max_chars": 0}, "max_chars"),
        ({"token_counter": object()}, "token_counter"),
    ],
)
def test_settings_are_checked(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MessagePlanner(**kwargs)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_call_without_messages_is_planned_as_it_is(api: str) -> None:
    """An empty ``messages`` list (the upstream refuses it, the planner must not fail first)."""
    planner = MessagePlanner()
    plan = planner.plan([], scope=Scope("empty"), api=api)  # type: ignore[arg-type]
    assert plan.messages == []
    again = planner.plan([], scope=Scope("empty"), api=api)  # type: ignore[arg-type]
    assert again.messages == []
