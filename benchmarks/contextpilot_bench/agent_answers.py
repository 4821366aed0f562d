"""``contextpilot-bench --workload agentic-mtrag | agentic-multihop-rag --engine vllm-cpu
--engine-model smollm2``: SmolLM2's answers after the tool results, each method's scored
against the plain agent's.

The answer call of a turn is the model call that follows the turn's last tool result (the
scripted model answers there; :func:`answer_calls` finds it from the messages as the scripted
model does: the ``n``-th user message is turn ``n``, and the tool results after it say which
step). Each method's answer calls are sent, as recorded and followed by one user message
(:data:`ANSWER_CUE`, the same in every method), to vLLM's CPU build serving
SmolLM2-135M-Instruct (:func:`~contextpilot_bench.testbed.smollm2.ensure_smollm2_dir`) with
``--chat-template`` :data:`SMOLLM2_TOOL_TEMPLATE` (the random-weights replay's tool template
without its ``bos_token``: SmolLM2's template writes none, and its ``bos_token`` is
``<|im_start|>``), and its greedy answer (``--engine-max-tokens``, default 32) is scored
against the data's references by the turn's request id
(:func:`~contextpilot_bench.answer_scoring.reference_answers`: MultiHop-RAG's answers, MTRAG-UN's
recorded replies and targets).

Methods: ``baseline`` (the plain LangChain agent), ``contextpilot`` (ContextPilotMiddleware)
and ``proxy`` (the plain agent's prompts as the proxy mode forwards them,
:func:`~contextpilot_bench.agent_proxy.plan_through_proxy`), those of them that ran. A turn is
kept only when every method's answer call fits SmolLM2's positions with the answer
(:func:`paired_answer_calls`): the methods answer the same turns, paired. Each method's calls
go in call order, session after session, on a prefix cache emptied before the method; every
call's ``prompt_tokens`` is checked against the local rendering of the template.

The cue is there because a 135M model is no agent: after a history of rendered tool calls it
answers a tool result with another tool call, or copies a pointer or an earlier turn's scripted
answer, as the real model's single-turn prompts need their answer cue
(:mod:`~contextpilot_bench.real_model`). The report counts the answers that are still a tool
call or a copied pointer, per method.

The history before a turn holds the scripted answers of the earlier turns, the same text in
every method, so what differs between the methods is only what the library changed in the
prompt (labelled documents, pointers to earlier tool results). A 135M model's answers are near
the floor: this is a no-collapse check (the paired interval of contextpilot - baseline includes
zero or lies above it), never evidence that the library improves answers
(:data:`~contextpilot_bench.real_model.WHAT_SCORES_SHOW`; docs/DESIGN.md,
"SmolLM2-135M-Instruct").
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contextpilot_bench.agent_engine import (
    PROXY_METHOD,
    TOOL_CHAT_TEMPLATE,
    checked_chat,
    kv_cache_gib,
    local_prompt_tokens,
    tool_chat_server,
    vllm_block_size,
)
from contextpilot_bench.agent_replay import AgentRun
from contextpilot_bench.agent_sessions import AgentSession, source_workload
from contextpilot_bench.answer_scoring import (
    METRICS,
    MethodScores,
    normalize_answer,
    reference_answers,
    score_document,
    score_methods,
)
from contextpilot_bench.real_model import WHAT_SCORES_SHOW
from contextpilot_bench.testbed.locations import require_testbed
from contextpilot_bench.vllm_setup import DEFAULT_ANSWER_TOKENS

__all__ = [
    "ANSWER_METHODS",
    "SMOLLM2_TOOL_TEMPLATE",
    "AnswerCall",
    "AnswerRun",
    "PairedCalls",
    "answer_calls",
    "answer_lines",
    "answer_on_smollm2",
    "paired_answer_calls",
]

ANSWER_METHODS = ("baseline", "contextpilot", PROXY_METHOD)
"""The methods whose answers are generated (those that ran), ``baseline`` first."""
VERDICT_METRICS = ("gold_contained", "f1")
"""The metrics whose paired difference to the baseline decides the no-collapse verdict."""
DEGENERATE_SHARE = 0.5
"""The plain agent's answers are degenerate when one normalised answer is more than this share
of them (a tiny model answering "Yes." to everything): equal scores then show nothing, and the
verdict says n/a unless a method dropped significantly."""
ANSWER_CUE = {
    "role": "user",
    "content": "Answer my last question in one short sentence, from the search results above.",
}
"""Appended to every method's answer call (module docstring)."""
_TOOL_CALL = "<call>"
_POINTER_COPY = re.compile(r"\bSame (?:result as|as document|\d+ lines as|line as)\b")
SMOLLM2_TOOL_TEMPLATE = TOOL_CHAT_TEMPLATE.removeprefix("{{ bos_token }}")
"""``--chat-template`` for SmolLM2 serving tool-calling chats (module docstring)."""


@dataclass(frozen=True)
class AnswerCall:
    """One turn's answer call: its session, the turn's request id and the messages sent."""

    session: str
    request_id: str
    messages: tuple[Mapping[str, Any], ...]


def answer_calls(run: AgentRun, sessions: Sequence[AgentSession]) -> list[AnswerCall]:
    """``run``'s answer calls in call order (module docstring).

    Raises:
        ValueError: a prompt of a session not in ``sessions``, without a user message, with
            more user messages than its session has turns, or answering a turn without a
            request id (a file session's).
    """
    script = {s.id: s.turns for s in sessions}
    out: list[AnswerCall] = []
    for position, prompt in enumerate(run.prompts):
        turns = script.get(prompt.session)
        if turns is None:
            raise ValueError(f"{run.method} call {position}: unknown session {prompt.session!r}")
        roles = [m.get("role") for m in prompt.messages]
        users = [i for i, role in enumerate(roles) if role == "user"]
        if not users or len(users) > len(turns):
            raise ValueError(
                f"{run.method} call {position}: {len(users)} user messages in session "
                f"{prompt.session!r} of {len(turns)} turns"
            )
        turn = turns[len(users) - 1]
        if sum(1 for role in roles[users[-1] :] if role == "tool") < len(turn.calls):
            continue
        if turn.request_id is None:
            raise ValueError(
                f"{run.method} call {position}: turn {len(users)} of session {prompt.session!r} "
                "has no request id (only search sessions' answers are scored)"
            )
        out.append(AnswerCall(prompt.session, turn.request_id, prompt.messages))
    return out


@dataclass
class PairedCalls:
    """The answer calls every method makes, kept where all of them fit.

    Attributes:
        calls: method -> its kept answer calls, in call order (the same turns in every method).
        prompt_tokens: method -> the kept calls' prompt tokens (local rendering).
        dropped: turns dropped because some method's prompt did not fit.
        longest: the longest kept prompt, tokens.
    """

    calls: dict[str, list[AnswerCall]] = field(default_factory=dict)
    prompt_tokens: dict[str, list[int]] = field(default_factory=dict)
    dropped: int = 0
    longest: int = 0

    @property
    def kept(self) -> int:
        """Turns kept (the same in every method)."""
        return len(next(iter(self.calls.values()), []))


def paired_answer_calls(
    runs: Sequence[AgentRun],
    sessions: Sequence[AgentSession],
    count_tokens: Callable[[Sequence[Mapping[str, Any]]], int],
    limit: int,
) -> PairedCalls:
    """The answer calls of ``runs`` (:func:`answer_calls`) on the turns where every method's
    prompt has at most ``limit`` tokens by ``count_tokens``.

    Raises:
        ValueError: no runs, or runs whose answer calls are not the same turns in the same
            order.
    """
    if not runs:
        raise ValueError("paired_answer_calls needs at least one run")
    found = {run.method: answer_calls(run, sessions) for run in runs}
    first = runs[0].method
    turns = [(c.session, c.request_id) for c in found[first]]
    for method, calls in found.items():
        if [(c.session, c.request_id) for c in calls] != turns:
            raise ValueError(
                f"the answer calls of {method} are not the same turns as {first}'s "
                f"({len(calls)} and {len(turns)} calls)"
            )
    tokens = {m: [count_tokens(c.messages) for c in calls] for m, calls in found.items()}
    keep = [all(tokens[m][i] <= limit for m in found) for i in range(len(turns))]
    out = PairedCalls(dropped=keep.count(False))
    for method, calls in found.items():
        out.calls[method] = [c for c, kept in zip(calls, keep, strict=True) if kept]
        out.prompt_tokens[method] = [
            t for t, kept in zip(tokens[method], keep, strict=True) if kept
        ]
    out.longest = max((max(t, default=0) for t in out.prompt_tokens.values()), default=0)
    return out


@dataclass
class AnswerRun:
    """SmolLM2's answers to the paired answer calls.

    Attributes:
        answers: method -> request id -> the generated answer.
        paired: the calls sent (:class:`PairedCalls`).
        settings: the model directory, block size, ``max_model_len``, answer tokens, the KV
            cache (GiB), the server's start-up seconds and the seconds in all.
    """

    answers: dict[str, dict[str, str]]
    paired: PairedCalls
    settings: dict[str, Any]


def answer_on_smollm2(
    runs: Sequence[AgentRun], sessions: Sequence[AgentSession], args: argparse.Namespace
) -> AnswerRun:
    """Generate SmolLM2's answer to every paired answer call of ``runs`` (those named in
    :data:`ANSWER_METHODS`) on a vLLM CPU server the call starts and stops; ``args``:
    ``block_size``, ``engine_python``, ``engine_model_dir``, ``engine_max_tokens`` and
    ``engine_startup_timeout`` of ``contextpilot-bench``.

    Raises:
        ValueError: no ``baseline`` among ``runs``, a block size that is not a positive
            multiple of 32, answer tokens below 1, or the benchmark's ``testbed`` extra
            missing.
        FileNotFoundError: no Python that runs vLLM.
        RuntimeError, TimeoutError: the model could not be prepared or the server did not
            start, or the server's prompt tokens differ from the local rendering.
        EngineError: the engine failed a request.
    """
    chosen = [r for r in runs if r.method in ANSWER_METHODS]
    chosen.sort(key=lambda r: ANSWER_METHODS.index(r.method))
    if not chosen or chosen[0].method != "baseline":
        raise ValueError(
            "SmolLM2's answers are scored against the plain LangChain agent's: run --agents "
            "langchain"
        )
    block_size = vllm_block_size(args)
    answer_tokens = getattr(args, "engine_max_tokens", None) or DEFAULT_ANSWER_TOKENS
    if answer_tokens < 1:
        raise ValueError(f"--engine-max-tokens must be >= 1, got {answer_tokens}")
    require_testbed()
    from contextpilot_bench.testbed.locations import require_vllm_python
    from contextpilot_bench.testbed.model_chat import ModelChat
    from contextpilot_bench.testbed.smollm2 import ensure_smollm2_dir

    began = time.perf_counter()
    python = require_vllm_python(args.engine_python)
    model_dir = ensure_smollm2_dir(args.engine_model_dir, python=python)
    base_chat = ModelChat.from_model_dir(model_dir)
    chat = ModelChat(base_chat.tokenizer, SMOLLM2_TOOL_TEMPLATE, base_chat.special_tokens)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    max_model_len = int(config["max_position_embeddings"])
    paired = paired_answer_calls(
        chosen,
        sessions,
        lambda messages: local_prompt_tokens(chat, [*messages, ANSWER_CUE]),
        max_model_len - answer_tokens,
    )
    answers: dict[str, dict[str, str]] = {r.method: {} for r in chosen}
    # A session's answer calls extend one another: its last holds all its distinct tokens.
    distinct = 0
    for method, calls in paired.calls.items():
        last = {c.session: t for c, t in zip(calls, paired.prompt_tokens[method], strict=True)}
        distinct = max(distinct, sum(last.values()))
    kv_gib = kv_cache_gib(config, distinct + max_model_len)
    startup = 0.0
    if paired.kept:
        with tool_chat_server(
            model_dir,
            SMOLLM2_TOOL_TEMPLATE,
            block_size=block_size,
            max_model_len=max_model_len,
            answer_tokens=answer_tokens,
            vllm_python=python,
            startup_timeout=args.engine_startup_timeout,
            kv_cache_space_gib=kv_gib,
            load_format="auto",
            model_name="smollm2",
        ) as (instance, _):
            startup = instance.server.startup_seconds or 0.0
            for method, calls in paired.calls.items():
                instance.reset()
                for position, call in enumerate(calls):
                    local = paired.prompt_tokens[method][position]
                    label = f"{method} answer call {position}"
                    rid = f"answer-{method}-{position}"
                    sent = [*call.messages, ANSWER_CUE]
                    done = checked_chat(instance, sent, rid, local, label)
                    answers[method][call.request_id] = done.text
    settings = {
        "model_dir": str(model_dir),
        "block_size": block_size,
        "max_model_len": max_model_len,
        "answer_tokens": answer_tokens,
        "kv_cache_gib": kv_gib,
        "startup_seconds": round(startup, 3),
        "seconds": round(time.perf_counter() - began, 3),
    }
    return AnswerRun(answers, paired, settings)


def _verdict(scores: MethodScores, degenerate: bool) -> str:
    differences = [scores.vs_baseline[m] for m in VERDICT_METRICS]
    parts = [f"{m} {d.describe()}" for m, d in zip(VERDICT_METRICS, differences, strict=True)]
    if not all(d.high >= 0 for d in differences):
        verdict = "MISSED (a significant drop)"
    elif degenerate:
        verdict = "n/a (the plain agent's answers are degenerate: no drop could show)"
    else:
        verdict = "ok"
    return (
        f"target: {scores.method} answers vs the plain agent's (SmolLM2, paired, points): "
        + "; ".join(parts)
        + f"; no collapse, each interval includes zero or lies above it: {verdict}"
    )


def answer_lines(
    workload: str, run: AnswerRun, data_dir: str | Path | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Score ``run``'s answers against agent workload ``workload``'s references; the report's
    lines and the JSON document (kept / dropped turns, settings, per method the scores with
    their intervals and paired differences, the answers).

    Raises:
        ValueError: ``workload`` is not a search agent workload.
        FileNotFoundError: the references' data file is missing.
    """
    references = reference_answers(source_workload(workload), data_dir)
    scores = score_methods(run.answers, references)
    paired, settings = run.paired, run.settings
    empty = {m: sum(1 for a in by_id.values() if not a.strip()) for m, by_id in run.answers.items()}
    calls = {m: sum(_TOOL_CALL in a for a in by_id.values()) for m, by_id in run.answers.items()}
    copies = {
        m: sum(_POINTER_COPY.search(a) is not None for a in by_id.values())
        for m, by_id in run.answers.items()
    }
    document: dict[str, Any] = {
        **settings,
        "kept_turns": paired.kept,
        "dropped_turns": paired.dropped,
        "longest_prompt_tokens": paired.longest,
        "questions": scores[0].questions if scores else 0,
        "empty_answers": empty,
        "tool_call_answers": calls,
        "pointer_copy_answers": copies,
        "what_scores_show": WHAT_SCORES_SHOW,
        "methods": {s.method: score_document(s) for s in scores},
        "answers": run.answers,
    }
    lines = [
        f"SmolLM2-135M-Instruct's answers after the tool results (vLLM CPU, "
        f"{settings['answer_tokens']} tokens at most, greedy; each method's answer calls on an "
        f"emptied prefix cache, {settings['seconds']:.0f} s in all): {paired.kept} turns kept, "
        f"{paired.dropped} dropped (some method's prompt over {settings['max_model_len']:,} "
        f"positions with the answer; longest kept {paired.longest:,} tokens)",
        "answers that are no answer, per method (empty / a tool call / a copied pointer): "
        + ", ".join(f"{m} {empty[m]} / {calls[m]} / {copies[m]}" for m in run.answers),
    ]
    if not scores:
        lines.append("answers not scored: no kept turn has a reference answer")
        return lines, document
    lines.append(
        f"answers scored on {scores[0].questions:,} turns with a reference (mean [95% bootstrap "
        "interval], points; vs baseline: paired difference):"
    )
    for s in scores:
        lines.append(
            f"  {s.method}: "
            + "; ".join(f"{m} {s.metrics[m].describe(signed=False)}" for m in METRICS)
        )
        if s.vs_baseline:
            diffs = [f"{m} {s.vs_baseline[m].describe()}" for m in METRICS]
            lines.append("    vs baseline: " + "; ".join(diffs))
    ids = scores[0].question_ids
    common, times = Counter(normalize_answer(run.answers["baseline"][i]) for i in ids).most_common(
        1
    )[0]
    degenerate = times > DEGENERATE_SHARE * len(ids)
    document["baseline_most_common_answer"] = {"answer": common, "turns": times}
    document["degenerate"] = degenerate
    lines.append(
        f"the plain agent's most common answer (normalised): {common!r} in {times} of "
        f"{len(ids)} scored turns"
        + (f", more than {DEGENERATE_SHARE:.0%}: degenerate" if degenerate else "")
    )
    lines += [_verdict(s, degenerate) for s in scores if s.vs_baseline]
    lines.append(f"what these scores show: {WHAT_SCORES_SHOW}")
    return lines, document
