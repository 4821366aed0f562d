"""``contextpilot-bench`` on a multi-turn workload: the conversations replayed turn by turn,
the whole conversation so far in every prompt (:mod:`~contextpilot_bench.multiturn`),
one run per ``--sessions`` value; with a real model the chat replay instead
(:mod:`~contextpilot_bench.chat_replay`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from contextpilot_bench import real_model
from contextpilot_bench.cli_arguments import DEFAULT_MULTITURN_CACHE_TOKENS
from contextpilot_bench.cli_option_values import parse_methods, parse_sessions
from contextpilot_bench.engine_setups import engine_setup
from contextpilot_bench.multiturn import (
    MULTITURN_METHODS,
    MultiTurnResult,
    run_multiturn,
)
from contextpilot_bench.multiturn_report import (
    MULTITURN_COLUMNS,
    PREFILL_TARGET,
    summarize_multiturn,
    write_multiturn_json,
)
from contextpilot_bench.prepared_conversations import prepare_conversations
from contextpilot_bench.report import format_table, plot_results, prefill_check
from contextpilot_bench.testbed.stop_signals import StopSignals
from contextpilot_bench.workloads import load_workload

__all__ = ["run_multiturn_report"]


def run_multiturn_report(args: argparse.Namespace, stop: StopSignals) -> int:
    """The multi-turn replay: one run per ``--sessions`` value, each method through a fresh
    engine; prints the table and the prefill target, writes JSON and plots."""
    if real_model.scores_answers(args):
        from contextpilot_bench.chat_replay import run_chat_replay

        return run_chat_replay(args, stop.check)
    methods = parse_methods(args.methods, MULTITURN_METHODS)
    sessions = parse_sessions(args.sessions)
    if args.history_turns is not None and args.history_turns < 0:
        raise ValueError(f"--history-turns must be >= 0, got {args.history_turns}")
    if args.retriever != "bm25":
        raise ValueError(
            f"--retriever {args.retriever} is not supported with --workload {args.workload} "
            "(the multi-turn replay retrieves with BM25)"
        )
    setup = engine_setup(
        args, default_cache=DEFAULT_MULTITURN_CACHE_TOKENS, multiturn=True, stop_check=stop.check
    )
    workload = load_workload(args.workload, args.data_dir).head(args.limit)
    started = time.perf_counter()
    prepared = prepare_conversations(
        workload, args.k, counter=setup.counter, retrieval_query=args.retrieval_query
    )
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    repeats = prepared.repeat_share
    history = "all earlier turns" if args.history_turns is None else f"last {args.history_turns}"
    run: dict[str, Any] = {
        "workload": workload.name,
        "conversations": len(prepared.conversations),
        "requests": prepared.turns,
        "documents": len(workload.corpus),
        "k": args.k,
        "retrieval_query": args.retrieval_query,
        "history_turns": args.history_turns,
        "sessions": sessions,
        "methods": methods,
        "token_counter": setup.counter_description,
        "unique_block_tokens": prepared.unique_block_tokens,
        "repeat_share": {
            "blocks": repeats.blocks,
            "repeated_blocks": repeats.repeated_blocks,
            "tokens": repeats.tokens,
            "repeated_tokens": repeats.repeated_tokens,
        },
    }
    results: list[MultiTurnResult] = []
    try:
        engine_line = setup.start(prepared, run)
        for n in sessions:
            for method in methods:
                results.append(
                    run_multiturn(
                        method,
                        prepared,
                        engine_factory=setup.new_engine,
                        sessions=n,
                        history_turns=args.history_turns,
                        progress=progress,
                    )
                )
    finally:
        setup.close()
    run["seconds"] = round(time.perf_counter() - started, 3)
    query = "the new user turn" if args.retrieval_query == "turn" else "the user turns so far"
    print(
        f"workload {workload.name}: {len(prepared.conversations):,} conversations, "
        f"{prepared.turns:,} turns, {len(workload.corpus):,} documents, BM25 top-{args.k} for "
        f"{query}; prompts hold {history}"
    )
    print(
        "retrieved blocks an earlier turn of the same conversation also retrieved: "
        f"{repeats.repeated_blocks:,} of {repeats.blocks:,} ({100 * repeats.block_share:.1f}%), "
        f"{100 * repeats.token_share:.1f}% of their tokens"
    )
    print(engine_line)
    print()
    rows = summarize_multiturn(results)
    print(format_table(rows, MULTITURN_COLUMNS))
    print()
    for line in prefill_check(rows, group="sessions"):
        print(line)
    target_applies = args.engine_url is None and run.get("cache_tokens") is None and args.k == 10
    for row in rows:
        if row["method"] == "alignment+dedup" and row["prefill_vs_baseline"] is not None:
            if target_applies:
                verdict = "ok" if row["prefill_vs_baseline"] <= PREFILL_TARGET else "MISSED"
                target = f"target <= {PREFILL_TARGET}: {verdict}"
            else:
                target = f"the target <= {PREFILL_TARGET} is for k=10 on an unlimited cache"
            print(
                f"sessions {row['sessions']}: alignment+dedup prefill tokens = "
                f"{row['prefill_vs_baseline']:.3f} of the baseline's ({target})"
            )
    if args.out:
        print(f"wrote {write_multiturn_json(args.out, run, results)}")
    if not args.no_plot:
        base = Path(args.plot or f"results/{workload.name}.png")
        for n in sessions:
            path = base if len(sessions) == 1 else base.with_stem(f"{base.stem}-sessions{n}")
            title = f"{workload.name}, {n} session(s) at a time, k={args.k}, {setup.plot_label}"
            chosen = [r.result for r in results if r.sessions == n]
            print(f"wrote {plot_results(path, chosen, title)}")
    return 0
