"""Multi-turn with a real model's own answers: MTRAG-UN conversations replayed as chat messages,
each turn's generated answer in the next turn's history.

``contextpilot-bench --workload mtrag-conversations --engine vllm-cpu --engine-model smollm2``.
Turn ``t`` is sent as ``[system] [user: turn 1] [assistant: turn 1's answer] ... [user: turn t]``
through the model's own chat template (the server applies it; the same ids are computed here,
:class:`~contextpilot_bench.testbed.model_chat.ModelChat`). A user message is the turn's header,
blocks and tail as the method renders them: ``baseline`` in retriever order;
``alignment+dedup``: ``ContextPilot.plan`` with ``Scope(conversation, turn=t)``, following the
engine through its KV events; ``alignment``: the same without a conversation. Answers are
greedy, ``--engine-max-tokens`` at most, scored by :mod:`~contextpilot_bench.answer_scoring`.

What is checked (:class:`~contextpilot_bench.chat_replay_report.ChatTurn`): the engine reuses
turn ``t - 1``'s prompt and answer only if they stay a token prefix of turn ``t``'s prompt. A
template that re-renders history (dropping reasoning, re-adding a default system prompt,
trimming whitespace) or an answer whose text re-encodes to other ids breaks that. Both are
measured: the generated ids come back from the engine (vLLM's ``return_token_ids``); what it
computed of turn ``t - 1`` is the prompt ids and the generated ids but the last (a sampled token
is never fed back); ``prefix_kept`` is how many of those start turn ``t``'s ids. The target
(:data:`~contextpilot_bench.chat_replay_report.REUSE_TARGET`) applies where the history fits:
nothing trimmed, the prompt within the KV cache, which is the engine's whole memory
(``VLLM_CPU_KVCACHE_SPACE``) unless ``--engine-kv-tokens`` is given. A conversation outgrowing
``max_model_len`` (default the model's ``max_position_embeddings``) loses its oldest turns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from contextpilot_bench.answer_scoring import (
    METRICS,
    reference_answers,
    score_methods,
)
from contextpilot_bench.chat_replay_report import (
    REUSE_TARGET,
    ChatTurn,
    plot_reuse,
    reuse_summary,
)
from contextpilot_bench.methods import engine_link, pilot_link
from contextpilot_bench.prepared_conversations import (
    PreparedConversations,
    ReplayTurn,
    interleave_turns,
    prepare_conversations,
)
from contextpilot_bench.real_model import WHAT_SCORES_SHOW, scored_layout
from contextpilot_bench.workloads import load_workload
from contextpilot_integrations.core.blocks import TokenizerCounter
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import Scope

if TYPE_CHECKING:
    from contextpilot_bench.vllm_instance import VllmCpuInstance

__all__ = ["CHAT_REPLAY_METHODS", "replay_conversations", "run_chat_replay"]

logger = logging.getLogger(__name__)

CHAT_REPLAY_METHODS = ("baseline", "alignment", "alignment+dedup")
DEFAULT_CHAT_METHODS = ("baseline", "alignment+dedup")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def replay_conversations(
    method: str,
    prepared: PreparedConversations,
    instance: VllmCpuInstance,
    *,
    sessions: int = 1,
    max_model_len: int,
    progress: bool = False,
) -> list[ChatTurn]:
    """Replay every conversation with ``method`` on an emptied cache (see the module docstring).

    Raises:
        ValueError: an unknown method.
        EngineError: the engine failed a request.
    """
    if method not in CHAT_REPLAY_METHODS:
        raise ValueError(f"method must be one of {CHAT_REPLAY_METHODS}, got {method!r}")
    from tqdm import tqdm

    layout = prepared.layout
    server = instance.server
    instance.reset()
    pilot = None
    if method != "baseline":
        link = engine_link(instance.cache_sync)
        pilot = ContextPilot(layout=layout, token_counter=prepared.counter, engine=link)
        instance.wait_for_events(*([link] if link is not None else []))
    system = [{"role": "system", "content": layout.system_prompt}] if layout.system_prompt else []
    # conversation -> earlier turns: (user message, answer, prompt ids, answer ids)
    history: dict[str, list[tuple[str, str, list[int], list[int]]]] = {}
    out: list[ChatTurn] = []
    budget = max_model_len - instance.answer_tokens
    capacity = instance.model_capacity_tokens
    try:
        order = interleave_turns(prepared.conversations, sessions)
        with tqdm(total=len(order), desc=method, unit="turn", disable=not progress) as bar:
            for turn in order:
                user = _user_message(method, turn, pilot, layout, f"{method}-{turn.request_id}")
                sent = _send_turn(method, turn, user, history, system, pilot, instance, budget)
                out.append(_with_fit(sent, capacity))
                bar.update()
        if (link := pilot_link(pilot)) is not None:
            instance.wait_for_events(link)
    finally:
        if pilot is not None:
            pilot.close()
    logger.info("%s: %d turns replayed with %s", method, len(out), server.model_name)
    return out


def _user_message(
    method: str, turn: ReplayTurn, pilot: ContextPilot | None, layout: PromptLayout, rid: str
) -> str:
    """The turn's user message: its header, blocks and tail as ``method`` renders them."""
    if pilot is None:
        segments = layout.render_segments(list(turn.blocks), turn.question)
        number = turn.number
    else:
        scope = (
            Scope(turn.conversation_id, turn=turn.number) if method == "alignment+dedup" else None
        )
        plan = pilot.plan(turn.question, turn.blocks, rid=rid, scope=scope)
        if turn.number != 1:
            # Behind its own conversation's history: nothing else can share its prefix.
            pilot.evict(plan.rid)
        segments = list(plan.segments)
        number = plan.scope.turn if plan.scope.turn is not None else turn.number
    turn_segments, _ = layout.render_turns([(number, segments[1:])])
    return "".join(turn_segments)


def _send_turn(
    method: str,
    turn: ReplayTurn,
    user: str,
    history: dict[str, list[tuple[str, str, list[int], list[int]]]],
    system: list[dict[str, str]],
    pilot: ContextPilot | None,
    instance: VllmCpuInstance,
    budget: int,
) -> ChatTurn:
    """Send one turn with its conversation's history (the oldest turns trimmed while the
    prompt exceeds ``budget`` tokens) and record it in ``history``."""
    server = instance.server
    rid = f"{method}-{turn.request_id}"
    earlier = history.setdefault(turn.conversation_id, [])
    trimmed = 0
    while True:
        messages = list(system)
        for past_user, past_answer, _, _ in earlier[trimmed:]:
            messages += [
                {"role": "user", "content": past_user},
                {"role": "assistant", "content": past_answer},
            ]
        messages.append({"role": "user", "content": user})
        ids = server.tokenize(messages)
        if len(ids) <= budget or trimmed == len(earlier):
            break
        trimmed += 1
    completion = instance.chat(messages, rid=rid, token_ids=True)
    if (link := pilot_link(pilot)) is not None:
        link.register_tokens(rid, ids)
    answer = completion.text
    answer_ids = server.chat.tokenizer.encode(answer, add_special_tokens=False).ids
    generated = completion.token_ids
    # what the engine computed of the answer: every generated id but the last (sampled, never
    # fed back); the text's own ids when the engine did not return them
    computed = list(generated[:-1]) if generated is not None else list(answer_ids)
    previous_tokens = previous_prompt = prefix_kept = 0
    if earlier and trimmed == 0:
        _, _, previous_ids, previous_answer = earlier[-1]
        expected = [*previous_ids, *previous_answer]
        previous_tokens, previous_prompt = len(expected), len(previous_ids)
        prefix_kept = _common_prefix(expected, ids)
    block = instance.block_size
    earlier.append((user, answer, ids, computed))
    return ChatTurn(
        request_id=turn.request_id,
        conversation_id=turn.conversation_id,
        number=turn.number,
        rid=rid,
        prompt_tokens=completion.prompt_tokens,
        local_prompt_tokens=len(ids),
        cached_tokens=completion.cached_tokens,
        ttft_s=completion.ttft_s,
        answer=answer,
        answer_tokens=len(answer_ids),
        generated_tokens=None if generated is None else len(generated),
        previous_tokens=previous_tokens,
        previous_prompt_tokens=previous_prompt,
        prefix_kept=prefix_kept,
        expected_cached=previous_tokens // block * block,
        trimmed_turns=trimmed,
        fits=trimmed == 0,
    )


def _with_fit(turn: ChatTurn, capacity: int | None) -> ChatTurn:
    """``turn`` with ``fits`` false also when its prompt exceeds the engine's KV cache."""
    if turn.fits and capacity is not None and turn.local_prompt_tokens > capacity:
        return dataclasses.replace(turn, fits=False)
    return turn


def run_chat_replay(args: argparse.Namespace, stop_check: Callable[[], None]) -> int:
    """The CLI's multi-turn run with a real model (see the module docstring); returns the exit
    status."""
    from contextpilot_bench.testbed.locations import require_vllm_python
    from contextpilot_bench.testbed.model_chat import ModelChat
    from contextpilot_bench.testbed.smollm2 import ensure_smollm2_dir
    from contextpilot_bench.vllm_instance import VllmCpuInstance

    methods = _methods(args.methods)
    sessions = int(str(args.sessions).split(",")[0])
    if args.history_turns is not None or args.retriever != "bm25":
        raise ValueError(
            "the chat replay keeps whole conversations (the oldest turns are trimmed only to fit "
            "max_model_len) and retrieves with BM25: drop --history-turns and --retriever"
        )
    if args.block_size <= 0 or args.block_size % 32:
        raise ValueError(f"--block-size must be a positive multiple of 32, got {args.block_size}")
    began = time.perf_counter()
    python = require_vllm_python(args.engine_python)
    model_dir = ensure_smollm2_dir(args.engine_model_dir, python=python)
    chat = ModelChat.from_model_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    max_model_len = args.engine_max_model_len or int(config["max_position_embeddings"])
    workload = load_workload(args.workload, args.data_dir).head(args.limit)
    layout = scored_layout()
    prepared = prepare_conversations(
        workload,
        args.k,
        counter=TokenizerCounter(chat.tokenizer),
        layout=layout,
        retrieval_query=args.retrieval_query,
    )
    from contextpilot_bench.kv_cache_size import size_kv_cache
    from contextpilot_bench.vllm_setup import DEFAULT_KV_TOKENS

    # A conversation's history must fit for its reuse to show: the engine's whole memory unless
    # --engine-kv-tokens says otherwise (as the multi-turn replay's unlimited default).
    spec = "unlimited" if args.engine_kv_tokens == DEFAULT_KV_TOKENS else args.engine_kv_tokens
    kv = size_kv_cache(spec, prepared.unique_block_tokens, args.block_size, max_model_len)
    answer_tokens = args.engine_max_tokens or 32
    instance = VllmCpuInstance(
        model_dir,
        block_size=args.block_size,
        num_gpu_blocks=kv.num_gpu_blocks,
        max_model_len=max_model_len,
        stop_check=stop_check,
        answer_tokens=answer_tokens,
        vllm_python=python,
        startup_timeout=args.engine_startup_timeout,
        load_format="auto",
        model_name="smollm2",
    )
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    turns: dict[str, list[ChatTurn]] = {}
    with instance:
        server = instance.server
        probe = [
            {"role": "system", "content": layout.system_prompt},
            {"role": "user", "content": "hi"},
        ]
        tokenize_ok = server.tokenize_on_server(probe) == server.tokenize(probe)
        for method in methods:
            turns[method] = replay_conversations(
                method,
                prepared,
                instance,
                sessions=sessions,
                max_model_len=max_model_len,
                progress=progress,
            )
        capacity = instance.model_capacity_tokens
    seconds = time.perf_counter() - began
    summaries = {m: reuse_summary(t) for m, t in turns.items()}
    references = reference_answers(workload.name, args.data_dir)
    answers = {m: {t.request_id: t.answer for t in ts} for m, ts in turns.items()}
    scores = score_methods(answers, references)
    print(
        f"workload {workload.name}: {len(prepared.conversations):,} conversations, "
        f"{prepared.turns:,} turns, BM25 top-{args.k}; chat messages through the model's own "
        f"template, each turn's generated answer ({answer_tokens} tokens at most, greedy) in "
        "the next turn's history"
    )
    print(
        f"engine: vLLM CPU, SmolLM2-135M-Instruct ({model_dir}), block size {args.block_size}, "
        f"{kv.describe()}, max_model_len {max_model_len:,}; local template = server /tokenize: "
        f"{tokenize_ok}; {seconds:.0f} s in all"
    )
    print()
    for method, summary in summaries.items():
        ratio = summary["cached_of_expected"]
        print(
            f"{method}: {summary['turns']} turns, hit ratio {summary['hit_ratio']:.4f}; later "
            f"turns whose history fits: {summary['target_applies']}, cached >= {REUSE_TARGET} of "
            f"the previous prompt + answer (whole blocks): {summary['target_met']} "
            f"({'n/a' if ratio is None else f'{ratio:.4f}'} of the expected tokens in all); "
            f"prefix broken: {summary['prefix_broken']} (by the template "
            f"{summary['prefix_broken_by_template']}, in the answer's re-encoded ids "
            f"{summary['prefix_broken_in_answer']}); history trimmed: "
            f"{summary['trimmed']}; local vs engine prompt-token mismatches: "
            f"{summary['local_token_mismatches']}"
        )
        applies = summary["target_applies"]
        verdict = "ok" if applies and summary["target_met"] == applies else "MISSED"
        print(f"  target (every turn that fits): {verdict if applies else 'n/a'}")
    if scores:
        print()
        print(f"answers scored on {scores[0].questions:,} turns (mean [95% interval], points):")
        for s in scores:
            parts = [f"{m} {s.metrics[m].describe(signed=False)}" for m in METRICS]
            print(f"  {s.method}: " + "; ".join(parts))
            if s.vs_baseline:
                diffs = [f"{m} {s.vs_baseline[m].describe()}" for m in METRICS]
                print("    vs baseline: " + "; ".join(diffs))
        print(f"what these scores show: {WHAT_SCORES_SHOW} (here each method's history holds its")
        print("own answers, so the turns after the first differ in more than the order)")
    if args.out:
        document = {
            "run": {
                "workload": workload.name,
                "conversations": len(prepared.conversations),
                "turns": prepared.turns,
                "k": args.k,
                "block_size": args.block_size,
                "kv_cache": asdict(kv),
                "kv_capacity_tokens": capacity,
                "max_model_len": max_model_len,
                "answer_tokens": answer_tokens,
                "tokenize_matches_server": tokenize_ok,
                "seconds": round(seconds, 1),
                "reuse_target": REUSE_TARGET,
            },
            "reuse": summaries,
            "answer_scores": {
                s.method: {
                    "metrics": {m: asdict(i) for m, i in s.metrics.items()},
                    "vs_baseline": {m: asdict(i) for m, i in s.vs_baseline.items()},
                }
                for s in scores
            },
            "turns": {m: [asdict(t) for t in ts] for m, ts in turns.items()},
        }
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    if not args.no_plot:
        plot_path = Path(args.plot or f"results/{workload.name}-chat-replay-smollm2.png")
        print(f"wrote {plot_reuse(plot_path, turns)}")
    return 0


def _methods(text: str | None) -> list[str]:
    if text is None:
        return list(DEFAULT_CHAT_METHODS)
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in CHAT_REPLAY_METHODS]
    if not methods or unknown or len(set(methods)) != len(methods):
        raise ValueError(
            f"--methods for the chat replay: distinct names from {list(CHAT_REPLAY_METHODS)}, "
            f"got {text!r}"
        )
    return methods
