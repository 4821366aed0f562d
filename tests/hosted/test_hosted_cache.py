"""Breakpoint placement, cache keys, usage parsing and the pilot's read-back, without a server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core.request import Scope
from contextpilot_integrations.llm_call.anthropic_breakpoints import (
    ANTHROPIC_MAX_BREAKPOINTS,
    AnthropicCachePolicy,
    anthropic_prompt,
)
from contextpilot_integrations.llm_call.cache_prefix import CachePrefix
from contextpilot_integrations.llm_call.engine_fields import (
    CacheUsageTracker,
    Usage,
    engine_body_fields,
    read_usage,
)
from contextpilot_integrations.llm_call.hosted_cache import create_message
from contextpilot_integrations.llm_call.openai_cache_key import (
    openai_cache_fields,
    prompt_cache_key,
)
from contextpilot_integrations.llm_call.provider_minimums import anthropic_min_cacheable_tokens
from contextpilot_integrations.sync.configuration import build_cache_state_source
from contextpilot_integrations.sync.ttl_model import TTLModel

DOC = "Fact {i} is stated in this sentence. "


def doc(i: int, tokens: int = 400) -> str:
    return f"Document {i}. " + DOC.format(i=i) * (tokens * 4 // 36)


def marked(prompt) -> list[tuple[int, int]]:
    out = [(-1, b) for b, block in enumerate(prompt.system or []) if "cache_control" in block]
    for m, message in enumerate(prompt.messages):
        out += [(m, b) for b, block in enumerate(message["content"]) if "cache_control" in block]
    return out


def test_minimum_per_model_longest_prefix_wins_and_overrides():
    assert anthropic_min_cacheable_tokens("claude-haiku-4-5-20251001") == 4096
    assert anthropic_min_cacheable_tokens("claude-3-5-haiku-latest") == 2048
    assert anthropic_min_cacheable_tokens("claude-opus-4-1") == 1024
    assert anthropic_min_cacheable_tokens("claude-opus-4-6") == 4096
    assert anthropic_min_cacheable_tokens("some-new-model") == 1024
    assert anthropic_min_cacheable_tokens(None) == 1024
    assert anthropic_min_cacheable_tokens("claude-x-1", {"claude-x": 512}) == 512
    assert AnthropicCachePolicy(model="claude-haiku-4-5", min_tokens=10).min_cacheable_tokens == 10


def test_shared_prefix_breakpoint_and_the_text_is_unchanged():
    pilot = ContextPilot()
    pilot.plan("a", [doc(0), doc(1), doc(2), doc(3)])
    plan = pilot.plan("b", [doc(0), doc(1), doc(2), doc(4)])
    prompt = anthropic_prompt(plan.messages, CachePrefix.of(plan))
    assert prompt.found_plan
    assert [bp.reason for bp in prompt.breakpoints] == ["shared-prefix"]
    assert marked(prompt) == [(0, 2)]  # one text block per rendered document
    assert prompt.messages[0]["content"][2]["cache_control"] == {"type": "ephemeral"}
    assert "".join(b["text"] for b in prompt.messages[0]["content"]) == plan.messages[1]["content"]
    one_hour = anthropic_prompt(plan.messages, CachePrefix.of(plan), AnthropicCachePolicy(ttl="1h"))
    assert one_hour.messages[0]["content"][2]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}


def test_below_the_minimum_no_breakpoint_at_all():
    pilot = ContextPilot()
    pilot.plan("a", [doc(0, 100), doc(1, 100)])
    plan = pilot.plan("b", [doc(0, 100), doc(1, 100), doc(2, 100)])
    assert plan.shared_prefix_blocks == 2
    prompt = anthropic_prompt(
        plan.messages, CachePrefix.of(plan), AnthropicCachePolicy(documents="always")
    )
    assert prompt.breakpoints == () and marked(prompt) == []


def test_conversation_history_and_documents_breakpoints():
    pilot = ContextPilot()
    scope = Scope("conversation-1")
    first = pilot.plan("a", [doc(0), doc(1), doc(2)], scope=scope)
    history = [*first.messages[1:], {"role": "assistant", "content": "answer " * 400}]
    second = pilot.plan("b", [doc(3), doc(4), doc(5)], scope=scope)
    messages = [second.messages[0], *history, second.messages[1]]
    prompt = anthropic_prompt(messages, CachePrefix.of(second))
    reasons = [bp.reason for bp in prompt.breakpoints]
    assert reasons == ["history", "documents"]  # stable history ends; this turn's documents
    assert prompt.breakpoints[0].message == 1  # the end of the assistant's answer
    assert len(marked(prompt)) == 2


def test_without_a_plan_only_system_and_history():
    messages = [
        {"role": "system", "content": doc(9, 1200)},
        {"role": "user", "content": doc(8)},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "next question"},
    ]
    prompt = anthropic_prompt(messages, None)
    assert [bp.reason for bp in prompt.breakpoints] == ["system", "history"]
    assert not prompt.found_plan


def test_existing_markers_count_and_too_many_are_refused():
    marker = {"cache_control": {"type": "ephemeral"}}
    content = [{"type": "text", "text": doc(i), **marker} for i in range(3)]
    pilot = ContextPilot()
    pilot.plan("a", [doc(0), doc(1), doc(2), doc(3)])
    plan = pilot.plan("b", [doc(0), doc(1), doc(2), doc(5)])
    messages = [plan.messages[0], {"role": "user", "content": content}, plan.messages[1]]
    policy = AnthropicCachePolicy(system=False)
    prompt = anthropic_prompt(messages, CachePrefix.of(plan), policy)
    assert len(marked(prompt)) <= ANTHROPIC_MAX_BREAKPOINTS
    content.append({"type": "text", "text": "x", **marker})
    content.append({"type": "text", "text": "y", **marker})
    with pytest.raises(ValueError, match="already carry 5"):
        anthropic_prompt([{"role": "user", "content": content}], None)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(10, 900), min_size=1, max_size=12),
    shared=st.integers(0, 12),
    history=st.lists(st.integers(0, 1500), max_size=4),
    minimum=st.integers(0, 5000),
    system=st.integers(0, 2000),
    conversation=st.booleans(),
    existing=st.integers(0, 2),
)
def test_never_more_than_four_never_below_the_minimum(
    sizes, shared, history, minimum, system, conversation, existing
):
    blocks = tuple(f"[Doc {i + 1}]\n" + "w" * (4 * n) + "\n-----\n" for i, n in enumerate(sizes))
    messages = [{"role": "system", "content": "s" * (4 * system) or "s"}]
    for i, n in enumerate(history):
        messages.append(
            {"role": "user" if i % 2 == 0 else "assistant", "content": "h" * (4 * n + 1)}
        )
    marker = [{"type": "text", "text": "m", "cache_control": {"type": "ephemeral"}}] * existing
    messages.append(
        {"role": "user", "content": [*marker, {"type": "text", "text": "".join(blocks) + "Q?"}]}
    )
    prefix = CachePrefix(blocks, shared, conversation=conversation)
    prompt = anthropic_prompt(messages, prefix, AnthropicCachePolicy(min_tokens=minimum))
    assert len(marked(prompt)) <= ANTHROPIC_MAX_BREAKPOINTS
    assert all(bp.tokens >= minimum for bp in prompt.breakpoints)
    assert len(prompt.breakpoints) + existing == len(marked(prompt))
    sent = "".join(b["text"] for m in prompt.messages for b in m["content"])
    assert sent == "".join(
        m["content"] if isinstance(m["content"], str) else "".join(b["text"] for b in m["content"])
        for m in messages[1:]
    )


def test_prompt_cache_key_stable_shared_by_a_group_salted_per_tenant():
    a = CachePrefix((), 0, (11, 22, 33))
    b = CachePrefix((), 2, (11, 22, 44))
    assert prompt_cache_key(a) == prompt_cache_key(b) == prompt_cache_key(CachePrefix((), 0, (11,)))
    assert prompt_cache_key(a, depth=2) == prompt_cache_key(b, depth=2)
    assert prompt_cache_key(a, depth=3) != prompt_cache_key(b, depth=3)
    assert prompt_cache_key(a) != prompt_cache_key(CachePrefix((), 0, (11,), salt="tenant-2"))
    assert (
        prompt_cache_key(a)
        == "cp-"
        + __import__("hashlib")
        .blake2b(b"\x00" + (11).to_bytes(8, "big"), digest_size=12)
        .hexdigest()
    )  # a hash of ids: the same in every process
    assert openai_cache_fields(a, retention="24h")["prompt_cache_retention"] == "24h"
    with pytest.raises(ValueError):
        openai_cache_fields(a, retention="forever")  # type: ignore[arg-type]


def test_engine_body_fields_for_hosted_apis():
    plan = ContextPilot(cache_salt="salt").plan("q", [doc(0)])
    assert engine_body_fields(plan, "anthropic") == {}
    assert engine_body_fields(plan, "hosted") == {}
    assert engine_body_fields(plan, "openai") == {
        "prompt_cache_key": prompt_cache_key(CachePrefix.of(plan))
    }
    assert engine_body_fields(plan.rid, "openai") == {}


def test_read_usage_in_every_form():
    class Obj:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    anthropic_usage = {
        "input_tokens": 10,
        "cache_read_input_tokens": 1000,
        "cache_creation_input_tokens": 200,
    }
    assert read_usage({"usage": anthropic_usage}) == Usage(1210, 1000, 200)
    assert read_usage(Obj(usage=Obj(**anthropic_usage))) == Usage(1210, 1000, 200)
    assert read_usage(Obj(raw={"usage": Obj(**anthropic_usage)})) == Usage(1210, 1000, 200)
    assert read_usage({"usage": {"input_tokens": 50}}) == Usage(50, 0, 0)
    assert read_usage({"usage": {"input_tokens": 50}}).uncached
    openai_usage = {"prompt_tokens": 2000, "prompt_tokens_details": {"cached_tokens": 1152}}
    assert read_usage({"usage": openai_usage}) == Usage(2000, 1152, None)
    lc_anthropic = {
        "input_tokens": 1210,
        "input_token_details": {
            "cache_read": 1000,
            "cache_creation": 0,
            "ephemeral_5m_input_tokens": 200,
            "ephemeral_1h_input_tokens": 0,
        },
    }
    assert read_usage(Obj(usage_metadata=lc_anthropic)) == Usage(1210, 1000, 200)
    lc_openai = {"input_tokens": 2000, "input_token_details": {"cache_read": 1152}}
    assert read_usage(Obj(usage_metadata=lc_openai)) == Usage(2000, 1152, None)
    assert read_usage({"usage": None}) is None and read_usage(object()) is None


def test_record_usage_counts_writes_and_refreshes():
    pilot = ContextPilot()
    # Three calls of one prompt: each its own plan and rid (a rid reported again counts once).
    plans = [pilot.plan("q", [doc(0), doc(1)]) for _ in range(3)]
    assert pilot.record_usage(plans[0].rid, 1210, 0, cache_write_tokens=1200)
    assert pilot.record_usage(plans[1].rid, 1210, 1200, cache_write_tokens=0)
    assert pilot.record_usage(plans[2].rid, 1210, 0, cache_write_tokens=0)  # stays: docstring
    plan = plans[0]
    usage = pilot.stats()["usage"]
    assert usage["cache_write_tokens"] == 1200 and usage["cached_tokens"] == 1200
    assert usage["uncached_reports"] == 1 and usage["reports"] == 3
    with pytest.raises(ValueError):
        pilot.record_usage(plan.rid, 10, 8, cache_write_tokens=5)


def test_tracker_forwards_writes_and_falls_back_for_an_old_planner():
    calls = []

    class OldPlanner:
        def record_usage(self, rid, prompt_tokens, cached_tokens):
            calls.append((rid, prompt_tokens, cached_tokens))
            return True

    tracker = CacheUsageTracker(OldPlanner())
    usage = {
        "usage": {
            "input_tokens": 10,
            "cache_read_input_tokens": 5,
            "cache_creation_input_tokens": 0,
        }
    }
    tracker.record("r1", usage)
    tracker.record("r2", usage)
    assert calls == [("r1", 15, 5), ("r2", 15, 5)]
    assert tracker.stats()["cache_write_tokens"] == 0 and tracker.stats()["cached_tokens"] == 10


def test_ttl_presets_take_the_model_minimum():
    assert TTLModel.anthropic(model="claude-haiku-4-5").min_cached_tokens == 4096
    assert TTLModel.anthropic(model="claude-sonnet-4-6", one_hour=True).ttl_s == 3600.0
    source = build_cache_state_source(
        {"kind": "ttl", "provider": "anthropic", "model": "claude-3-haiku"}, None
    )
    assert source.min_cached_tokens == 2048  # type: ignore[attr-defined]
    source = build_cache_state_source({"kind": "ttl", "provider": "openai"}, None)
    assert source.min_cached_tokens == 1024 and source.ttl_s == 300.0  # type: ignore[attr-defined]
    clock = [0.0]
    model = TTLModel.anthropic(
        model="claude-sonnet-4-6", min_cached_tokens=0, clock=lambda: clock[0]
    )
    from contextpilot_integrations.sync.cache_state_source import SentRequest

    model.record(SentRequest("r", ((1, 2000),)))
    clock[0] = 250.0
    assert model.touch("r")  # a read refreshes the lifetime
    clock[0] = 500.0
    assert model.expire() == []
    clock[0] = 560.0
    assert model.expire() == ["r"]


# ---------------------------------------------------------------------- tools, system, history
MARK = {"cache_control": {"type": "ephemeral"}}


class RecordingClient:
    """Stands in for ``anthropic.Anthropic``: records what ``messages.create`` is given."""

    def __init__(self) -> None:
        self.messages = self
        self.sent: list[dict] = []

    def create(self, **kwargs):  # type: ignore[no-untyped-def]
        self.sent.append(kwargs)
        return {"usage": {"input_tokens": 1}}


def markers_sent(kwargs: dict) -> int:
    """Every cache_control of a ``messages.create`` call: tools, system and messages."""
    blocks = [*kwargs.get("tools", ())]
    if isinstance(kwargs.get("system"), list):
        blocks += kwargs["system"]
    for message in kwargs["messages"]:
        if isinstance(message["content"], list):
            blocks += message["content"]
    return sum("cache_control" in block for block in blocks)


def tool(name: str, marked: bool = False) -> dict:
    schema = {"type": "object"}
    return {"name": name, "description": "d", "input_schema": schema, **(MARK if marked else {})}


def planned_turn() -> tuple[object, list[dict]]:
    """A conversation's second turn sharing its first documents with another request: the
    policy wants system, history, shared-prefix (and within it) and documents breakpoints."""
    pilot = ContextPilot()
    pilot.plan("other", [doc(0), doc(1), doc(2), doc(7)])
    first = pilot.plan("a", [doc(5), doc(6)], scope=Scope("chat"))
    plan = pilot.plan("b", [doc(0), doc(1), doc(2), doc(3)], scope=Scope("chat"))
    history = [first.messages[1], {"role": "assistant", "content": "answer " * 400}]
    return plan, history


def test_markers_on_tools_count_against_the_limit():
    plan, history = planned_turn()
    client = RecordingClient()
    marked_history = [{**history[0], "content": [{"type": "text", "text": "x" * 40, **MARK}]}]
    create_message(
        client,
        plan,
        model="claude-sonnet-4-6",
        max_tokens=8,
        history=[*marked_history, history[1]],
        tools=[tool("search", marked=True)],
    )
    assert markers_sent(client.sent[-1]) == ANTHROPIC_MAX_BREAKPOINTS  # one tool, one app's, two
    assert client.sent[-1]["tools"] == [tool("search", marked=True)]  # sent as given
    tools = [tool(f"t{i}", marked=True) for i in range(4)]
    with pytest.raises(ValueError, match=r"already carry 5 cache_control .*\(4 on tools\)"):
        create_message(client, plan, model="m", max_tokens=8, history=marked_history, tools=tools)


@settings(max_examples=80, deadline=None)
@given(
    tools=st.lists(st.booleans(), max_size=5),
    system=st.lists(st.booleans(), max_size=3),
    history=st.lists(st.lists(st.booleans(), min_size=1, max_size=3), max_size=4),
    minimum=st.sampled_from([0, 1024, 4096]),
)
def test_never_more_than_four_counting_tools_system_and_history(tools, system, history, minimum):
    """The app's own markers at random on its tools, system blocks and history blocks: the
    request never carries more than four in all, and never fewer than the app's."""
    plan, _ = planned_turn()
    own_tools = [tool(f"t{i}", marked) for i, marked in enumerate(tools)]
    own_system = [{"type": "text", "text": "s" * 400, **(MARK if m else {})} for m in system]
    own_history = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": [{"type": "text", "text": "h" * 800, **(MARK if m else {})} for m in turn],
        }
        for i, turn in enumerate(history)
    ]
    own = sum(tools) + sum(system) + sum(sum(turn) for turn in history)
    client = RecordingClient()
    call = dict(
        policy=AnthropicCachePolicy(min_tokens=minimum),
        history=own_history,
        tools=own_tools,
        model="claude-sonnet-4-6",
        max_tokens=8,
        **({"system": own_system} if own_system else {}),
    )
    if own > ANTHROPIC_MAX_BREAKPOINTS:
        with pytest.raises(ValueError, match="cache_control breakpoints"):
            create_message(client, plan, **call)
        return
    create_message(client, plan, **call)
    sent = client.sent[-1]
    assert own <= markers_sent(sent) <= ANTHROPIC_MAX_BREAKPOINTS
    if own_system:  # the app's system text first, then the plan's system prompt
        assert [b["text"] for b in sent["system"]][: len(own_system)] == ["s" * 400] * len(system)
        assert sent["system"][-1]["text"] == plan.messages[0]["content"]


def test_an_empty_history_message_stays_an_empty_string():
    plan, history = planned_turn()
    client = RecordingClient()
    empty = {"role": "assistant", "content": ""}
    create_message(client, plan, model="m", max_tokens=8, history=[history[0], empty])
    assert client.sent[-1]["messages"][1] == empty  # never [], which Anthropic refuses
    prompt = anthropic_prompt(
        [{"role": "user", "content": ""}, {"role": "user", "content": "q"}],
        None,
    )
    assert prompt.messages[0]["content"] == ""


def test_the_apps_system_goes_before_the_plans_system_prompt():
    plan, _ = planned_turn()
    client = RecordingClient()
    create_message(client, plan, model="m", max_tokens=8, system="You are a pirate.")
    system = client.sent[-1]["system"]
    assert [b["text"] for b in system] == ["You are a pirate.", plan.messages[0]["content"]]
    assert not any("pirate" in str(m["content"]) for m in client.sent[-1]["messages"])
    with pytest.raises(TypeError, match="system must be a str or a list of text blocks"):
        create_message(client, plan, model="m", max_tokens=8, system=3)


def _lifetimes(prompt) -> list[str]:  # type: ignore[no-untyped-def]
    """The lifetimes of every marker in prompt order (system, then messages)."""
    blocks = [*(prompt.system or []), *(b for m in prompt.messages for b in m["content"])]
    return [b["cache_control"].get("ttl", "5m") for b in blocks if "cache_control" in b]


def test_added_breakpoints_never_put_a_five_minute_entry_before_a_one_hour_one():
    # Anthropic refuses 5-minute entries before 1-hour ones: a client marking its newest
    # message for an hour gets the added system and history breakpoints for an hour too.
    long = "word " * 3000
    messages = [
        {"role": "system", "content": long},
        {"role": "user", "content": long},
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": long, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
            ],
        },
    ]
    prompt = anthropic_prompt(messages, None)
    assert len(prompt.breakpoints) == 2
    assert _lifetimes(prompt) == ["1h", "1h", "1h"]
    # A policy of an hour after a client's 5-minute marker on a tool: 5 minutes, in order.
    tools = [{"name": "t", "input_schema": {}, "cache_control": {"type": "ephemeral"}}]
    plain = [{**m, "content": long} if m["role"] == "user" else m for m in messages]
    one_hour = anthropic_prompt(plain, None, AnthropicCachePolicy(ttl="1h"), tools=tools)
    assert _lifetimes(one_hour) == ["5m", "5m"]
    # Without client markers the policy's lifetime holds.
    assert _lifetimes(anthropic_prompt(plain, None, AnthropicCachePolicy(ttl="1h"))) == [
        "1h",
        "1h",
    ]
