"""SmolLM2's answers in the agent replays, the parts that need no engine: which call answers a
turn, the pairing that drops a turn for every method, the tool template without its bos, the
scores and the no-collapse verdict (which must be able to fail), and the CLI's refusals. The
engine run itself is in the ``vllm`` tier (``tests/testbed/test_agent_answers_vllm.py``)."""

from __future__ import annotations

import dataclasses

import pytest
from contextpilot_bench.agent_answers import (
    SMOLLM2_TOOL_TEMPLATE,
    AnswerRun,
    PairedCalls,
    answer_calls,
    answer_lines,
    paired_answer_calls,
)
from contextpilot_bench.agent_proxy import plan_through_proxy
from contextpilot_bench.agent_replay import AgentRun, replay_langchain
from contextpilot_bench.agent_sessions import AgentSession, agent_sessions
from contextpilot_bench.answer_scoring import reference_answers
from contextpilot_bench.cli import main
from contextpilot_bench.retrieval import ScopedBM25
from contextpilot_bench.testbed.model_chat import ModelChat
from support.agent_workload import small_mtrag_workload


def _runs() -> tuple[list[AgentSession], list[AgentRun]]:
    workload = small_mtrag_workload()
    sessions = agent_sessions("agentic-mtrag", workload, 2)
    index = ScopedBM25(workload)
    runs = [replay_langchain(m, sessions, index) for m in ("baseline", "contextpilot")]
    return sessions, [*runs, plan_through_proxy(runs[0])]


def test_the_answer_call_of_each_turn_carries_its_request_id() -> None:
    sessions, runs = _runs()
    assert [t.request_id for s in sessions for t in s.turns] == ["a::0", "a::1", "b::2", "b::3"]
    for run in runs:
        calls = answer_calls(run, sessions)
        assert [(c.session, c.request_id) for c in calls] == [
            ("1:a", "a::0"), ("1:a", "a::1"), ("2:b", "b::2"), ("2:b", "b::3"),
        ]  # fmt: skip
        # The third call of every turn: after the turn's two search results.
        answered = [p.messages for i, p in enumerate(run.prompts) if i % 3 == 2]
        assert [c.messages for c in calls] == answered
        assert all(m[-1]["role"] == "tool" for m in answered)
    # A prompt of a session that is not among the sessions is an error, not skipped.
    with pytest.raises(ValueError, match="unknown session"):
        answer_calls(runs[0], sessions[:1])


def test_a_turn_over_the_limit_in_any_method_is_dropped_in_all() -> None:
    sessions, runs = _runs()

    def size(messages: object) -> int:
        return len(str(messages))

    sizes = {r.method: [size(c.messages) for c in answer_calls(r, sessions)] for r in runs}
    everything = paired_answer_calls(runs, sessions, size, 10**9)
    assert (everything.kept, everything.dropped) == (4, 0)
    # The plain agent's second answer of each session is its longest prompt: a limit just
    # under it drops those turns for every method, though the others' prompts fit.
    limit = max(sizes["baseline"][1], sizes["baseline"][3]) - 1
    assert max(sizes["contextpilot"]) <= limit
    paired = paired_answer_calls(runs, sessions, size, limit)
    assert paired.kept + paired.dropped == 4 and paired.dropped >= 1
    kept = {m: [c.request_id for c in calls] for m, calls in paired.calls.items()}
    assert kept["baseline"] == kept["contextpilot"] == kept["proxy"]
    assert all(t <= limit for tokens in paired.prompt_tokens.values() for t in tokens)
    assert paired.longest == max(max(t) for t in paired.prompt_tokens.values())
    # Runs that answer different turns cannot be paired.
    short = dataclasses.replace(runs[1], prompts=runs[1].prompts[:6])
    with pytest.raises(ValueError, match="not the same turns"):
        paired_answer_calls([runs[0], short], sessions, size, 10**9)


def test_the_smollm2_tool_template_writes_no_bos() -> None:
    # SmolLM2's bos_token is <|im_start|>: with the bos the prompt would open with it twice.
    chat = ModelChat(None, SMOLLM2_TOOL_TEMPLATE, {"bos_token": "<|im_start|>"})  # type: ignore[arg-type]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "search", "arguments": "{}"}}
        ]},
        {"role": "tool", "tool_call_id": "c", "content": "R"},
    ]  # fmt: skip
    assert chat.render(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\n<call>search {}</call><|im_end|>\n"
        "<|im_start|>tool\nR<|im_end|>\n<|im_start|>assistant\n"
    )


def _answer_run(answers: dict[str, dict[str, str]]) -> AnswerRun:
    settings = {"answer_tokens": 32, "max_model_len": 8192, "seconds": 1.0}
    return AnswerRun(answers, PairedCalls(dropped=1, longest=10), settings)


def test_answers_are_scored_and_a_collapse_is_missed(data_dir: object) -> None:
    references = reference_answers("multihop-rag", str(data_dir))
    ids = sorted(references)[:40]
    gold = {i: f"The answer is {references[i][0]}." for i in ids}
    # A collapse: no answer, a tool call, a copied pointer.
    collapsed = [
        "",
        '<call>search {"query": "q"}</call>',
        '[Same result as search({"query": "q"}) above.]',
        "Same as document [Doc 2] of search above.",
    ]
    proxy = {i: collapsed[n % 4] for n, i in enumerate(ids)}
    lines, document = answer_lines(
        "agentic-multihop-rag",
        _answer_run({"baseline": gold, "contextpilot": dict(gold), "proxy": proxy}),
        str(data_dir),
    )
    text = "\n".join(lines)
    assert "40 turns with a reference" in text
    assert (
        "(empty / a tool call / a copied pointer): baseline 0 / 0 / 0, contextpilot 0 / 0 / 0, "
        "proxy 10 / 10 / 20"
    ) in text
    assert document["methods"]["baseline"]["metrics"]["gold_contained"]["mean"] == 1.0
    assert document["methods"]["contextpilot"]["vs_baseline"]["f1"]["mean"] == 0.0
    assert (
        "target: contextpilot answers vs the plain agent's (SmolLM2, paired, points): "
        "gold_contained +0.0 [+0.0, +0.0]; f1 +0.0 [+0.0, +0.0]; no collapse, each interval "
        "includes zero or lies above it: ok"
    ) in lines
    assert any(
        line.startswith("target: proxy answers") and line.endswith("MISSED (a significant drop)")
        for line in lines
    )
    assert lines[-1].startswith("what these scores show: answer quality of a 135M-parameter")


@pytest.mark.parametrize(
    "argv",
    [
        "--workload agentic-mtrag --engine-model smollm2",
        "--workload agentic-file-edits --engine vllm-cpu --engine-model smollm2",
        "--workload agentic-mtrag --engine vllm-cpu --engine-model smollm2 --agents llamaindex",
    ],
)
def test_the_cli_refuses_answers_it_cannot_score(
    argv: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv.split()) == 2
    assert "scores the answers of the plain LangChain agent" in capsys.readouterr().err


def test_degenerate_plain_answers_make_the_verdict_not_applicable(data_dir: object) -> None:
    references = reference_answers("multihop-rag", str(data_dir))
    ids = sorted(references)[:40]
    yes = {i: "Yes." for i in ids}
    run = _answer_run({"baseline": yes, "contextpilot": dict(yes), "proxy": {i: "" for i in ids}})
    lines, document = answer_lines("agentic-multihop-rag", run, str(data_dir))
    assert document["degenerate"] is True
    assert document["baseline_most_common_answer"] == {"answer": "yes", "turns": 40}
    assert "the plain agent's most common answer (normalised): 'yes' in 40 of 40 scored turns" in (
        "\n".join(lines)
    )
    marker = "includes zero or lies above it: "
    verdicts = {line.split()[1]: line.split(marker)[1] for line in lines if "target:" in line}
    # Equal answers show nothing when they are all "Yes."; a drop from them still shows.
    assert verdicts["contextpilot"].startswith("n/a (the plain agent's answers are degenerate")
    assert verdicts["proxy"] == "MISSED (a significant drop)"
