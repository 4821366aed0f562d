"""The agent replays' accounting: prefill on a hand-computed prompt sequence, pointers checked
against the tools' own output, prefix breaks counted, and small real replays (2 sessions)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from contextpilot_bench.agent_accounting import (
    AgentPrompt,
    dangling_pointers,
    pointer_count,
    prefill_tokens,
    prefix_breaks,
)
from contextpilot_bench.agent_llamaindex import llamaindex_unavailable, replay_llamaindex
from contextpilot_bench.agent_proxy import plan_through_proxy
from contextpilot_bench.agent_replay import replay_langchain
from contextpilot_bench.agent_sessions import agent_sessions
from contextpilot_bench.cli import main
from contextpilot_bench.proxy_processes import send_through_peers
from contextpilot_bench.rag_proxy import VARIANTS, rag_rows
from contextpilot_bench.retrieval import ScopedBM25
from support.agent_workload import small_mtrag_workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter

VARIANTS_NAMES = [name for _, _, name in VARIANTS]

COUNTER = ApproxTokenCounter()
TOOLS = ({"type": "function", "function": {"name": "search"}},)


def _call(call_id: str, query: str) -> dict[str, object]:
    arguments = json.dumps({"query": query})
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "search", "arguments": arguments},
            }
        ],
    }


def _tokens(message: object) -> int:
    return COUNTER.count(json.dumps(message, ensure_ascii=False, sort_keys=True))


def test_baseline_prefill_matches_the_hand_computed_value() -> None:
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "What is a KV cache?"}
    call = _call("c1", "kv cache")
    result = {"role": "tool", "tool_call_id": "c1", "content": "A cache of keys and values."}
    answer = {"role": "assistant", "content": "Keys and values."}
    first = AgentPrompt("s", TOOLS, (system, user))
    second = AgentPrompt("s", TOOLS, (system, user, call, result))
    third = AgentPrompt("s", TOOLS, (system, user, call, result, answer, user))
    served = prefill_tokens([first, second, third], COUNTER, None)
    tools = COUNTER.count(json.dumps(list(TOOLS), sort_keys=True))
    # ceil(bytes / 4) of each unit's canonical JSON: 54, 42, 50, 160, 80 and 52 bytes.
    assert (tools, _tokens(system), _tokens(user), _tokens(call)) == (14, 11, 13, 40)
    assert (_tokens(result), _tokens(answer)) == (20, 13)
    # Call 1: nothing cached. Call 2: the first prompt (38) is cached. Call 3: the second (98).
    assert served == [(38, 38), (98, 60), (124, 26)]
    assert prefix_breaks([first, second, third]) == []


def test_an_injected_change_is_a_prefix_break() -> None:
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "q"}
    first = AgentPrompt("s", TOOLS, (system, user))
    edited = AgentPrompt("s", TOOLS, ({"role": "system", "content": "Be long."}, user, user))
    other = AgentPrompt("t", TOOLS, (user,))
    assert prefix_breaks([first, other, edited]) == [2]
    served = prefill_tokens([first, edited], COUNTER, None)
    assert served[1][1] == served[1][0] - 14  # only the tools (14 tokens) are cached


def _pointer_prompt(earlier: str) -> tuple[AgentPrompt, dict[str, str]]:
    doc1, doc2 = "Paged attention stores KV in blocks.", "Radix trees share prefixes."
    first = f"[Doc 1]\n{doc1}\n-----\n[Doc 2]\n{doc2}\n-----\n"
    second = f"[Doc 1]\n{doc2}\n-----\n"
    signature = 'search({"query": "kv"})'
    pointer = f"[Same as document [Doc 2] of {signature} above.]"
    sent = f"[Doc 1]\n{pointer}\n-----\n"
    messages = (
        {"role": "user", "content": "q"},
        _call("c1", "kv"),
        {"role": "tool", "tool_call_id": "c1", "content": earlier.format(first=first)},
        _call("c2", "radix"),
        {"role": "tool", "tool_call_id": "c2", "content": sent},
    )
    return AgentPrompt("s", TOOLS, messages), {"c1": first, "c2": second}


def test_pointers_are_checked_against_the_tools_output() -> None:
    prompt, originals = _pointer_prompt("{first}")
    assert pointer_count(prompt) == 1
    assert dangling_pointers(prompt, originals) == []
    # The earlier result no longer holds the document: the pointer dangles.
    broken, originals = _pointer_prompt("[Doc 1]\nsomething else\n-----\n[Doc 2]\nother\n")
    assert len(dangling_pointers(broken, originals)) == 1
    # The sent text does not map back to what the tool returned.
    prompt, originals = _pointer_prompt("{first}")
    assert len(dangling_pointers(prompt, {**originals, "c2": "unrelated"})) == 1


def _read_call(call_id: str) -> dict[str, object]:
    function = {"name": "read_file", "arguments": json.dumps({"path": "a.py"})}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "function": function}],
    }


def _run_prompt(earlier: str, ending: str = "\n") -> tuple[AgentPrompt, dict[str, str]]:
    """A file read twice, one line edited between the reads; the second read sent with its
    first three lines as a run pointer (its last line's quote cut short)."""
    lines = [f"    line_{i:02d} = some_code_here({i}){ending}" for i in range(6)]
    edited = f"    line_03 = edited(){ending}"
    call = 'read_file({"path": "a.py"})'
    pointer = (
        f"[Same 3 lines as in the result of {call} above, from the line "
        'starting "    line_00 = some_code_here(0)" to the line starting '
        '"    line_02 = some_c\u2026".]'
    )
    sent = pointer + ending + edited + "".join(lines[4:])
    messages = (
        {"role": "user", "content": "q"},
        _read_call("c1"),
        {"role": "tool", "tool_call_id": "c1", "content": earlier.format(file="".join(lines))},
        _read_call("c2"),
        {"role": "tool", "tool_call_id": "c2", "content": sent},
    )
    originals = {"c1": "".join(lines), "c2": "".join(lines[:3]) + edited + "".join(lines[4:])}
    return AgentPrompt("s", TOOLS, messages), originals


def test_run_pointers_are_checked_against_the_tools_output() -> None:
    for ending in ("\n", "\r\n"):
        prompt, originals = _run_prompt("{file}", ending)
        assert pointer_count(prompt) == 1
        assert dangling_pointers(prompt, originals) == []
        # the earlier result reads otherwise: the quotes find another stretch, or none
        broken, originals = _run_prompt("    line_00 = some_code_here(0), more\n{file}", ending)
        assert len(dangling_pointers(broken, originals)) == 1
        broken, originals = _run_prompt("    line_00 = some_code_here(0)\nother\n", ending)
        assert len(dangling_pointers(broken, originals)) == 1
        prompt, originals = _run_prompt("{file}", ending)
        assert len(dangling_pointers(prompt, {**originals, "c2": "unrelated"})) == 1


def test_passage_pointers_are_put_back_before_the_rest_is_mapped() -> None:
    # A plain retriever's passages, one line each, joined by blank lines: between two pointers
    # stands a blank line, which stands inside a replaced stretch too, so only putting the
    # stretches back first maps the sent text to the tool's output without doubt.
    passages = [f"Passage {i}: " + "words of the passage " * 8 + f"({i})" for i in range(5)]
    call = 'search({"query": "kv"})'
    first = "\n\n".join(passages[:4])
    second = "\n\n".join([passages[0], passages[1], passages[4], passages[3]])
    run = (
        f"[Same 3 lines as in the result of {call} above, from the line "
        f'starting "Passage 0: words of the p\u2026" to the line starting "Passage 1: words '
        'of the p\u2026".]'
    )
    line = (
        f"[Same line as in the result of {call} above, the line starting "
        '"Passage 3: words of the p\u2026".]'
    )
    sent = f"{run}\n\n{passages[4]}\n\n{line}"
    messages = (
        {"role": "user", "content": "q"},
        _call("c1", "kv"),
        {"role": "tool", "tool_call_id": "c1", "content": first},
        _call("c2", "kv again"),
        {"role": "tool", "tool_call_id": "c2", "content": sent},
    )
    prompt = AgentPrompt("s", TOOLS, messages)
    assert pointer_count(prompt) == 2
    assert dangling_pointers(prompt, {"c1": first, "c2": second}) == []
    # a quote that finds another passage, or a tool output the pointers do not stand for
    wrong = sent.replace('"Passage 3: words', '"Passage 2: words')
    changed = (*messages[:4], {**messages[4], "content": wrong})
    broken = dataclasses.replace(prompt, messages=changed)
    assert len(dangling_pointers(broken, {"c1": first, "c2": second})) == 1
    assert len(dangling_pointers(prompt, {"c1": first, "c2": second + "x"})) == 1


def test_a_scripted_session_costs_its_hand_counted_messages() -> None:
    workload = small_mtrag_workload()
    (session,) = agent_sessions("agentic-mtrag", workload.head(1), 1)
    run = replay_langchain("baseline", [session], ScopedBM25(workload))
    first, second, third = run.prompts
    roles = [m["role"] for m in third.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert first.messages == third.messages[:2] and second.messages == third.messages[:4]
    tools = COUNTER.count(json.dumps(list(third.tools), ensure_ascii=False, sort_keys=True))
    sizes = [_tokens(m) for m in third.messages]
    # Call 1 prefills the tools, system and user message; each later call its two new
    # messages (the tool call and its result): the whole of the last prompt, once.
    served = prefill_tokens(run.prompts, COUNTER, None)
    assert [p for _, p in served] == [tools + sizes[0] + sizes[1], sizes[2] + sizes[3],
                                      sizes[4] + sizes[5]]  # fmt: skip
    assert [t for t, _ in served] == [tools + sum(sizes[:n]) for n in (2, 4, 6)]


def test_two_sessions_replay_planned_without_breaks_or_dangling_pointers() -> None:
    workload = small_mtrag_workload()
    sessions = agent_sessions("agentic-mtrag", workload, 2)
    assert [len(s.turns) for s in sessions] == [2, 2]
    index = ScopedBM25(workload)
    base = replay_langchain("baseline", sessions, index)
    pilot = replay_langchain("contextpilot", sessions, index)
    assert len(base.prompts) == len(pilot.prompts) == 12  # 2 sessions x 2 turns x 3 calls
    for run in (base, pilot):
        assert prefix_breaks(run.prompts) == []
        assert all(dangling_pointers(p, run.originals[p.session]) == [] for p in run.prompts)
    assert sum(pointer_count(p) for p in pilot.prompts) > 0
    base_prefill = sum(p for _, p in prefill_tokens(base.prompts, COUNTER, None))
    pilot_prefill = sum(p for _, p in prefill_tokens(pilot.prompts, COUNTER, None))
    assert pilot_prefill < base_prefill
    # The proxy's own planning on the plain agent's prompts: sound pointers, no breaks.
    proxied = plan_through_proxy(base)
    assert proxied.method == "proxy" and len(proxied.prompts) == len(base.prompts)
    assert prefix_breaks(proxied.prompts) == []
    assert all(dangling_pointers(p, proxied.originals[p.session]) == [] for p in proxied.prompts)
    proxy_prefill = sum(p for _, p in prefill_tokens(proxied.prompts, COUNTER, None))
    assert proxy_prefill < base_prefill
    # An edited earlier message in a later call is caught.
    last = pilot.prompts[-1]
    messages = list(last.messages)
    messages[1] = {**messages[1], "content": "edited"}
    injected = [*pilot.prompts[:-1], dataclasses.replace(last, messages=tuple(messages))]
    assert prefix_breaks(injected) == [len(injected) - 1]


def test_two_proxy_processes_plan_as_one_and_unaware_ones_do_not() -> None:
    workload = small_mtrag_workload()
    index = ScopedBM25(workload)
    sessions = agent_sessions("agentic-mtrag", workload, 2)
    rows = {r["method"]: r for r in rag_rows(sessions, index, COUNTER)}
    single = [rows[f"rag-single ({n})"] for n in VARIANTS_NAMES]
    named = [rows[f"rag-conversations ({n})"] for n in VARIANTS_NAMES]
    assert all(r["calls"] == 4 for r in (*single, *named))
    # Document calls without a conversation all go to the tenant's owner: as one process.
    assert single[1]["prefill_tokens"] == single[0]["prefill_tokens"]
    assert single[0]["hit_ratio"] > 0
    # Unaware processes split the index and lose the with-documents messages of a named
    # conversation (its later calls go back plain): prefix misses.
    assert single[2]["hit_ratio"] < single[0]["hit_ratio"]
    assert named[2]["hit_ratio"] < min(named[0]["hit_ratio"], named[1]["hit_ratio"])
    # The agent's calls through two peers over HTTP go out as one process plans them.
    base = replay_langchain("baseline", sessions[:1], index)
    spread = send_through_peers(base, 2, "proxy-2-peers")
    assert [p.messages for p in spread.prompts] == [
        p.messages for p in plan_through_proxy(base).prompts
    ]


def test_hosted_methods_mark_breakpoints() -> None:
    workload = small_mtrag_workload()
    sessions = agent_sessions("agentic-mtrag", workload, 1)
    index = ScopedBM25(workload)
    caching = replay_langchain("anthropic-caching", sessions, index)
    assert all(0 in p.breakpoints and 1 in p.breakpoints for p in caching.prompts)
    assert prefix_breaks(caching.prompts) == []


@pytest.mark.skipif(llamaindex_unavailable() is not None, reason="LlamaIndex agent not importable")
def test_llamaindex_replay_is_planned() -> None:
    workload = small_mtrag_workload()
    sessions = agent_sessions("agentic-mtrag", workload, 2)
    index = ScopedBM25(workload)
    base = replay_llamaindex("llamaindex-baseline", sessions, index)
    pilot = replay_llamaindex("llamaindex-contextpilot", sessions, index)
    assert len(base.prompts) == len(pilot.prompts) == 12
    assert prefix_breaks(pilot.prompts) == []
    assert all(dangling_pointers(p, pilot.originals[p.session]) == [] for p in pilot.prompts)


def test_cli_runs_two_agentic_mtrag_sessions(
    data_dir: object, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["--workload", "agentic-mtrag", "--agent-sessions", "2", "--data-dir", str(data_dir)]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "dangling pointers: 0 (target 0: ok)" in out
    assert "prefix breaks: 0 (target 0: ok)" in out
    assert "AnthropicPromptCachingMiddleware's" in out


def test_cli_runs_one_agentic_multihop_session_with_langchain_only(
    data_dir: object, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workload", "agentic-multihop-rag", "--agent-sessions", "1", "--agents", "langchain"]
    code = main([*argv, "--data-dir", str(data_dir)])
    out = capsys.readouterr().out
    assert code == 0
    assert "contextpilot prefill tokens vs the plain agent's" in out
    assert "llamaindex" not in out and "hosted Anthropic" not in out
    # the proxy's planning on the plain agent's prompts, in process
    assert "\nproxy " in out and "planned in process by the proxy mode" in out
    # ... and over two proxy processes, agent and RAG calls
    assert "proxy-2-peers hit ratio vs one process's (unlimited cache) = 1.000" in out
    assert "rag-conversations (peers) hit ratio vs one process's = 1.000" in out


def test_cli_rejects_an_unknown_agent(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workload", "agentic-mtrag", "--agents", "sdk"]) == 2
    assert "--agents takes values from" in capsys.readouterr().err
