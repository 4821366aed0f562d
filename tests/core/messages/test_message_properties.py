"""Planning over messages against random agent histories (docs/DESIGN.md, "Sure hints",
"Byte-stable history", "Lossless", "Isolation", "Deterministic").

Each history is a few conversations of a few tenants, interleaved: turns of tool calls whose
results repeat whole or share documents (the library's rendered ``[Doc n]`` blocks, numbered,
tagged, JSON), with edits, trims, summaries, removed messages and apps that send back what was
sent (as it is, or trimmed and edited afterwards, its pointers' targets perhaps gone), between
calls. Every plan is checked by
code written here, independent of the planner's own check: every pointer's target text stands
verbatim earlier in the same request and its named call is there, every earlier result of a
call its name stands for (the same signature, or one starting with a short name's prefix) reads
the same (none is ambiguous), and no pointer text goes out that is neither the app's own nor
such a pointer (none dangles); every earlier message is
replayed byte for byte when the history extends what was sent; assistant, user and system
messages never change; every tool result can be restored from the plan; and a shared planner
gives each conversation what a planner of its own would.
"""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.messages import MessagePlan, MessagePlanner
from contextpilot_integrations.core.messages.message_shapes import Api
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import Scope

WORDS = ["alpha", "beta", "gamma", "delta", "kv", "cache", "prefix", "engine", "token", "page"]
DOCS = [
    f"Doc {i}: " + " ".join(random.Random(i).choice(WORDS) for _ in range(30)) for i in range(10)
]
LAYOUT = PromptLayout()
SIGNATURES = [
    ("search", {"query": "kv"}),
    ("search", {"query": "cache"}),
    ("fetch", {"url": "https://a.example/x"}),
    ("lookup", {"id": 7}),
    ("search", {"query": "prefix", "k": 5}),
    ("fetch", {"url": "https://b.example/y"}),
    ("lookup", {"id": 8}),
    # Long queries sharing prefixes: named by a prefix, longer where another call shares it,
    # whole where no prefix is unique (one question is the other's with a tail).
    ("search", {"query": "Who founded the company that makes the kv cache engine?"}),
    ("search", {"query": "Who founded the company that makes the radix tree index?"}),
    ("search", {"query": "Who founded the company that makes the kv cache engine, and when?"}),
    ("search", {"query": "Who founded the company that makes the radix tree index?", "k": 5}),
]
ELLIPSIS_CUT = "\u2026)"


def _result_text(rng: random.Random, earlier: list[str]) -> str:
    kind = rng.randrange(8)
    if kind == 0 and earlier:
        return rng.choice(earlier) + rng.choice(["", "\n", "  "])
    chosen = rng.sample(DOCS, rng.randint(1, 4))
    if kind == 1:
        return chosen[0]
    if kind == 2:
        head = rng.choice(["", "Results:\n\n"])
        return head + "\n\n".join(f"[{n}] {d}" for n, d in enumerate(chosen, 1))
    if kind == 3:
        return "\n".join(f'<document index="{n}">\n{d}\n</document>' for n, d in enumerate(chosen))
    if kind == 4:
        items = [{"id": f"d{DOCS.index(d)}", "text": d} for d in chosen]
        return json.dumps(rng.choice([items, {"results": items}]), indent=rng.choice([None, 1]))
    if kind == 5:
        return "\n\n".join(f"{n}. {d}" for n, d in enumerate(chosen, 1))
    if kind == 6:  # the library's own renderer: [Doc n] blocks, hints, the order annotation
        order = rng.sample(range(len(chosen)), len(chosen)) if rng.random() < 0.5 else []
        hints = [f"Also relevant: [Doc {rng.randint(1, 4)}] of turn 1, shown above."][
            : rng.randrange(2)
        ]
        blocks = "".join(LAYOUT.render_block(n, d) for n, d in enumerate(chosen))
        return blocks + LAYOUT.context_tail(
            annotation_labels=[LAYOUT.label(n) for n in order], hints=hints
        )
    return f"unique output {rng.random()} " + chosen[0][:40]


class Conversation:
    """One conversation as abstract events, rendered to either API's messages."""

    def __init__(self, rng: random.Random, name: str) -> None:
        self.rng = rng
        self.name = name
        self.events: list[dict[str, Any]] = [{"kind": "system", "text": f"System of {name}."}]
        self.calls = 0

    def turn(self) -> None:
        rng = self.rng
        self.events.append({"kind": "user", "text": f"question {rng.randrange(1000)}"})
        earlier = [e["text"] for e in self.events if e["kind"] == "result"]
        for _ in range(rng.randint(1, 3)):
            calls = []
            for _ in range(rng.randint(1, 2)):
                self.calls += 1
                name, arguments = rng.choice(SIGNATURES)
                calls.append((f"{self.name}-call{self.calls}", name, arguments))
            self.events.append({"kind": "calls", "calls": calls, "text": rng.choice(["", "ok"])})
            for call_id, _, _ in calls:
                text = _result_text(rng, earlier)
                earlier.append(text)
                self.events.append(
                    {"kind": "result", "id": call_id, "text": text, "list": rng.random() < 0.3}
                )
        self.events.append({"kind": "assistant", "text": f"answer {rng.randrange(1000)}"})

    def change(self) -> None:
        rng, events = self.rng, self.events
        what = rng.randrange(4)
        if len(events) < 3:
            return
        if what == 0:
            event = rng.choice(
                [e for e in events if e["kind"] in ("user", "result")] or [events[0]]
            )
            event["text"] = event["text"] + " (edited)"
        elif what == 1:
            del events[1 : 1 + rng.randint(1, len(events) - 1)]
        elif what == 2:
            k = rng.randint(1, len(events) - 1)
            events[1 : 1 + k] = [{"kind": "user", "text": f"Summary of {k} messages."}]
        else:
            del events[rng.randrange(1, len(events))]

    def render(self, api: str) -> tuple[list[dict[str, Any]], Any]:
        messages: list[dict[str, Any]] = []
        system = None
        for event in self.events:
            kind, text = event["kind"], event["text"]
            if kind == "system":
                if api == "openai":
                    messages.append({"role": "system", "content": text})
                else:
                    system = text
            elif kind in ("user", "assistant"):
                messages.append({"role": kind, "content": text})
            elif kind == "calls":
                if api == "openai":
                    messages.append(
                        {
                            "role": "assistant",
                            "content": text or None,
                            "tool_calls": [
                                {
                                    "id": i,
                                    "type": "function",
                                    "function": {"name": n, "arguments": json.dumps(a)},
                                }
                                for i, n, a in event["calls"]
                            ],
                        }
                    )
                else:
                    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
                    blocks += [
                        {"type": "tool_use", "id": i, "name": n, "input": a}
                        for i, n, a in event["calls"]
                    ]
                    messages.append({"role": "assistant", "content": blocks})
            else:
                content: Any = [{"type": "text", "text": text}] if event["list"] else text
                if api == "openai":
                    messages.append(
                        {"role": "tool", "tool_call_id": event["id"], "content": content}
                    )
                else:
                    block = {"type": "tool_result", "tool_use_id": event["id"], "content": content}
                    last = messages[-1] if messages else None
                    if last is not None and last.get("_results"):
                        last["content"].append(block)
                    else:
                        messages.append({"role": "user", "content": [block], "_results": True})
        for message in messages:
            message.pop("_results", None)
        return messages, system


# ------------------------------------------------------------------ independent checks
def _units(messages: list[dict[str, Any]], api: str) -> dict[tuple[int, int], dict[str, Any]]:
    """Every tool result by (message, block): its call id and its text (None: not plain)."""
    units = {}
    for i, message in enumerate(messages):
        if api == "openai" and message["role"] == "tool":
            units[(i, -1)] = {"id": message["tool_call_id"], "text": _text(message["content"])}
        elif (
            api == "anthropic"
            and message["role"] == "user"
            and isinstance(message["content"], list)
        ):
            for j, block in enumerate(message["content"]):
                if block["type"] == "tool_result":
                    units[(i, j)] = {"id": block["tool_use_id"], "text": _text(block["content"])}
    return units


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if len(content) == 1 and content[0]["type"] == "text":
        return content[0]["text"]
    return None


def _call_before(messages: list[dict[str, Any]], api: str, call_id: str, before: int) -> str | None:
    """The signature of the nearest assistant tool call with ``call_id`` before message
    ``before``."""
    for message in reversed(messages[:before]):
        if message["role"] != "assistant":
            continue
        if api == "openai":
            for call in message.get("tool_calls") or ():
                if call["id"] == call_id:
                    return f"{call['function']['name']}({call['function']['arguments']})"
        elif isinstance(message["content"], list):
            for block in reversed(message["content"]):
                if block["type"] == "tool_use" and block["id"] == call_id:
                    return f"{block['name']}({json.dumps(block['input'], ensure_ascii=False)})"
    return None


def _named(name: str, signature: str | None) -> bool:
    """Whether a pointer's call ``name`` stands for ``signature``: the same text, or a name cut
    short, ``name(prefix…)``, whose prefix ``signature`` starts with."""
    if signature is None:
        return False
    if name.endswith(ELLIPSIS_CUT):
        return signature.startswith(name[: -len(ELLIPSIS_CUT)])
    return signature == name


def _without_results(message: dict[str, Any], api: str) -> dict[str, Any]:
    copied = json.loads(json.dumps(message))
    if api == "openai" and copied["role"] == "tool":
        copied["content"] = None
    elif api == "anthropic" and isinstance(copied["content"], list):
        for block in copied["content"]:
            if block["type"] == "tool_result":
                block["content"] = None
    return copied


def check_plan(
    messages: list[dict[str, Any]],
    plan: MessagePlan,
    api: str,
    app: list[dict[str, Any]] | None = None,
) -> None:
    """``plan`` for ``messages``, the app's history ``app`` (default: ``messages``) as given,
    perhaps partly as sent before (with pointers)."""
    app = messages if app is None else app
    out = plan.messages
    assert len(out) == len(messages) == len(app)
    for given_message, sent in zip(app, out):
        assert _without_results(sent, api) == _without_results(given_message, api)
    given_units, sent_units = _units(app, api), _units(out, api)
    assert given_units.keys() == sent_units.keys()
    by_unit: dict[tuple[int, int], list[Any]] = {}
    for p in plan.placements:
        by_unit.setdefault((p.message, -1 if p.block is None else p.block), []).append(p)
    assert by_unit.keys() == given_units.keys()  # a placement for every tool result
    assert plan.tokens_removed == sum(p.tokens_saved for p in plan.placements)
    assert all(p.reason != "not verified" for p in plan.placements)  # plans pass their own check
    for position, unit in given_units.items():
        original, sent_text = unit["text"], sent_units[position]["text"]
        pointers = [p for p in by_unit[position] if p.status == "pointer"]
        if not pointers:
            assert sent_text == original
            continue
        assert sent_text is not None and original is not None
        if any(p.document is None for p in pointers):
            assert len(pointers) == 1 and sent_text == pointers[0].pointer
        elif sent_text != original:  # no pointer unreported
            # (a document that is itself a pointer the app gave back can be pointed at too)
            replaced = sum(p.original.count("[Same ") for p in pointers)
            assert sent_text.count("[Same ") == original.count("[Same ") - replaced + len(pointers)
        restored = sent_text
        for p in sorted(pointers, key=lambda p: p.offset, reverse=True):
            said = p.pointer if p.target_call in p.pointer else json.loads(f'"{p.pointer}"')
            assert p.target_call is not None and p.target_call in said
            assert restored[p.offset : p.offset + len(p.pointer)] == p.pointer
            restored = restored[: p.offset] + p.original + restored[p.offset + len(p.pointer) :]
            # the target: earlier in this request, holding the replaced text verbatim
            there = (p.target_message, -1 if p.target_block is None else p.target_block)
            assert there < position
            target = sent_units[there]["text"]
            assert target is not None
            if p.document is None:
                assert target.strip() == p.original.strip()
            else:
                assert p.original in target
                assert p.target_label is None or p.target_label in target
            named = _call_before(out, api, sent_units[there]["id"], p.target_message)
            assert _named(p.target_call, named)
            # not ambiguous: every earlier result of a call the name stands for reads the same
            whole_pointer = f"[Same result as {p.target_call} above.]"
            for where, unit in sent_units.items():
                if where >= position or where == there:
                    continue
                if _named(p.target_call, _call_before(out, api, unit["id"], where[0])):
                    assert unit["text"] is not None
                    assert unit["text"].strip() == target.strip() or unit["text"] == whole_pointer
        if any(p.document is None for p in pointers):
            assert restored.strip() == original.strip()
        else:
            assert restored == original
    # no dangling pointer: every pointer text sent is the app's own or a checked placement
    said = sum((u["text"] or "").count("[Same ") for u in sent_units.values())
    own = sum((u["text"] or "").count("[Same ") for u in given_units.values())
    replaced = sum((p.original or "").count("[Same ") for p in plan.pointers)
    assert said == own - replaced + len(plan.pointers)


def _extends(messages: list[Any], before: tuple[list[Any], list[Any]] | None) -> int:
    """How many leading messages equal what was given or sent before."""
    if before is None:
        return 0
    given_before, sent_before = before
    n = 0
    while n < min(len(messages), len(given_before)) and messages[n] in (
        given_before[n],
        sent_before[n],
    ):
        n += 1
    return n


def run_history(seed: int, api: Api) -> list[str]:
    rng = random.Random(seed)
    shared = MessagePlanner(max_conversations=100)
    own: dict[tuple[str, str], MessagePlanner] = {}
    keys = [("t1", "c1"), ("t2", "c1"), ("t1", "c2")]
    conversations = {key: Conversation(rng, f"{key[0]}{key[1]}") for key in keys}
    last: dict[tuple[str, str], tuple[list[Any], list[Any]]] = {}
    as_sent: dict[tuple[str, str], dict[str, Any]] = {}  # app's message (JSON) -> sent
    transcript = []
    for _ in range(rng.randint(3, 9)):
        key = rng.choice(keys)
        conversation = conversations[key]
        if rng.random() < 0.3:
            conversation.change()
        conversation.turn()
        app, system = conversation.render(api)
        messages = app
        keeps = rng.random()
        if key in last and keeps < 0.15:  # an app that keeps what was sent
            _, sent_before = last[key]
            n = _extends(messages, last[key])
            messages = sent_before[:n] + messages[n:]
        elif keeps < 0.4:  # one that keeps every message as sent, then trims and edits them
            sent_as = as_sent.get(key, {})
            messages = [sent_as.get(json.dumps(m, sort_keys=True), m) for m in app]
        snapshot = json.dumps(messages)
        scope = Scope(conversation_id=key[1], tenant=key[0])
        plan = shared.plan(messages, scope=scope, api=api, system=system)
        assert json.dumps(messages) == snapshot  # the input is never changed
        check_plan(messages, plan, api, app)
        as_sent.setdefault(key, {}).update(
            (json.dumps(m, sort_keys=True), sent) for m, sent in zip(app, plan.messages)
        )
        alone = own.setdefault(key, MessagePlanner()).plan(
            messages, scope=scope, api=api, system=system
        )
        assert alone == plan  # nothing crosses conversations or tenants
        n = _extends(messages, last.get(key))
        assert plan.replayed >= n
        sent_before = last[key][1] if key in last else []
        assert json.dumps(plan.messages[:n]) == json.dumps(sent_before[:n])  # byte-identical
        unscoped = MessagePlanner().plan(messages, api=api, system=system)
        assert unscoped.replayed == 0 and unscoped.diverged_at is None
        check_plan(messages, unscoped, api)
        last[key] = (messages, plan.messages)
        transcript.append(json.dumps(plan.messages))
    return transcript


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["openai", "anthropic"]))
def test_random_agent_histories(seed: int, api: Api) -> None:
    run_history(seed, api)


def test_thousands_of_seeded_histories_make_pointers_and_replay() -> None:
    pointers = replayed = short = long_whole = 0
    for seed in range(700):
        api: Api = "openai" if seed % 2 else "anthropic"
        rng = random.Random(seed)
        planner = MessagePlanner()
        conversation = Conversation(rng, "c")
        scope = Scope(conversation_id="c")
        for _ in range(4):
            if rng.random() < 0.3:
                conversation.change()
            conversation.turn()
            messages, system = conversation.render(api)
            plan = planner.plan(messages, scope=scope, api=api, system=system)
            check_plan(messages, plan, api)
            pointers += len(plan.pointers)
            replayed += plan.replayed
            for p in plan.pointers:
                if (p.target_call or "").endswith(ELLIPSIS_CUT):
                    short += 1
                elif "Who founded" in (p.target_call or ""):
                    long_whole += 1
    assert pointers > 700 and replayed > 1400  # the histories do exercise both rules
    assert short > 100 and long_whole > 50  # and long names cut short, or whole where no cut is


def test_rendered_results_with_overlapping_documents_get_document_pointers() -> None:
    # Overlapping (not identical) rendered results: their shared documents become pointers
    # naming a [Doc n] label, every one of which check_plan finds standing where it points.
    by_label = 0
    for seed in range(200):
        api: Api = "openai" if seed % 2 else "anthropic"
        rng = random.Random(seed)
        planner = MessagePlanner()
        conversation = Conversation(rng, "c")
        for _ in range(3):
            conversation.turn()
            messages, system = conversation.render(api)
            plan = planner.plan(messages, scope=Scope(conversation_id="c"), api=api, system=system)
            check_plan(messages, plan, api)
            by_label += sum(
                1
                for p in plan.pointers
                if p.target_label is not None and p.target_label.startswith("[Doc ")
            )
    assert by_label > 50


def test_the_same_history_gives_the_same_messages() -> None:
    for seed in range(20):
        assert run_history(seed, "openai") == run_history(seed, "openai")
