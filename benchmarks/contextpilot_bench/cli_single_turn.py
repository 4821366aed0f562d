"""``contextpilot-bench`` on a single-turn workload through one engine: the methods side by
side and, with ``--arrival``, ContextPilot behind each planning window; prints the tables and
the targets, writes JSON and the plot.

Every engine (the embedded model, ``--engine-url``, ``--engine vllm-cpu``) goes through
:func:`run_single_turn_report`: only its setup differs
(:mod:`~contextpilot_bench.engine_setups`); a real model's answers are scored on
the way (:mod:`~contextpilot_bench.real_model`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from contextpilot_bench import real_model
from contextpilot_bench.arrivals import arrivals_for
from contextpilot_bench.cli_arguments import DEFAULT_CACHE_TOKENS
from contextpilot_bench.cli_option_values import parse_methods
from contextpilot_bench.engine_setups import engine_setup
from contextpilot_bench.methods import (
    CLAIRVOYANT_ARRIVAL,
    METHODS,
    MethodResult,
    PreparedWorkload,
    parse_cache_tokens,
    prepare_workload,
    run_method,
    run_methods,
    run_warm_started,
)
from contextpilot_bench.online_bounds import is_online_bound, parse_lookaheads, run_online_bounds
from contextpilot_bench.report import (
    WINDOW_COLUMNS,
    WINDOW_TARGET_CACHE,
    WINDOW_TARGET_VS_OFFLINE,
    clairvoyant_check,
    format_table,
    plot_results,
    plot_window_tradeoff,
    prefill_check,
    summarize,
    summarize_windows,
    write_json,
)
from contextpilot_bench.testbed.stop_signals import StopSignals
from contextpilot_bench.window_runner import WindowResult, run_window
from contextpilot_bench.workloads import load_workload
from contextpilot_integrations.core.window.window_policy import WindowPolicy

__all__ = ["OFFLINE_REFERENCE", "run_single_turn_report"]

_RETRIEVERS = {"bm25": "BM25", "mem0": "Mem0 search"}
OFFLINE_REFERENCE = "contextpilot offline"
"""With ``--arrival``: offline ContextPilot on the same requests, the figure windows aim at."""


def run_single_turn_report(
    args: argparse.Namespace, stop: StopSignals, windows: list[tuple[WindowPolicy, float | None]]
) -> int:
    """One run of the single-turn methods through the chosen engine (and, with ``--arrival``,
    ContextPilot behind each planning window)."""
    methods = parse_methods(args.methods, real_model.methods_for(args, METHODS))
    setup = engine_setup(
        args, default_cache=DEFAULT_CACHE_TOKENS, multiturn=False, stop_check=stop.check
    )
    started = time.perf_counter()
    workload = load_workload(args.workload, args.data_dir).head(args.limit)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    seed = 0 if args.seed is None else args.seed
    if args.warm_start is not None and windows:
        raise ValueError(
            f"--warm-start {args.warm_start} serves the second half of the requests without "
            "windows; drop --arrival"
        )
    # before retrieval: a replay of a workload without request times fails fast
    arrivals = [arrivals_for(args.arrival, workload, rate, seed) for _, rate in windows]
    if args.retriever == "mem0":
        from contextpilot_bench.mem0_workload import prepare_mem0_workload

        prepared = prepare_mem0_workload(
            workload, args.k, counter=setup.counter, store_dir=args.mem0_store, progress=progress
        )
    else:
        layout = getattr(setup, "prompt_layout", None)  # a real model's scored layout
        prepared = prepare_workload(workload, args.k, counter=setup.counter, layout=layout)
    if arrivals:  # every method sees the requests in arrival order
        prepared = prepared.reordered(arrivals[0].order)
    sample: PreparedWorkload | None = None
    if args.warm_start == "half":
        sample, prepared = prepared.halves()
        if not sample.retrieved:
            raise ValueError("--warm-start half needs at least 2 requests")

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
    if sample is not None:
        run.update(warm_start="half", warm_start_requests=len(sample.retrieved))
    if windows:
        policy = windows[0][0]
        run.update(
            arrival=args.arrival,
            window_ms=[p.window_s * 1000 for p, _ in windows],
            rate_per_s=[a.rate_per_s for a in arrivals],
            max_batch=policy.max_batch,
            window_adaptive=policy.adaptive,
            seed=seed,
        )
    window_results: list[WindowResult] = []
    offline: MethodResult | None = None
    try:
        engine_line = setup.start(prepared, run)
        engines = setup.new_engine
        runner = real_model.run_scored_methods if real_model.scores_answers(args) else run_methods
        results = runner(
            methods,
            prepared,
            mode=args.mode,
            engine_factory=engines,
            block_size=setup.block_size,
            progress=progress,
        )
        if sample is not None:
            results.append(
                run_warm_started(
                    prepared, sample, mode=args.mode, engine_factory=engines, progress=progress
                )
            )
        if args.online_bounds is not None:
            results += run_online_bounds(
                prepared,
                parse_lookaheads(args.online_bounds),
                engine_factory=engines,
                progress=progress,
            )
        if windows:
            offline = run_method(
                "contextpilot", prepared, mode="offline", engine_factory=engines, progress=progress
            )
            offline.method = OFFLINE_REFERENCE
            for (policy, _), times in zip(windows, arrivals, strict=True):
                window_results.append(
                    run_window(prepared, times, policy, engine_factory=engines, progress=progress)
                )
        # in the order their engines were created (a setup reports per engine)
        created = [*results, *([offline] if offline else []), *(w.result for w in window_results)]
        notes = setup.report(created, run)
        notes += real_model.answer_lines(results, prepared, run, args.data_dir)
    finally:
        setup.close()
    run["seconds"] = round(time.perf_counter() - started, 3)

    arrival = f", arrivals {args.arrival}" if windows else ""
    if sample is not None:
        arrival += (
            f", served the last {len(prepared.retrieved):,} (warm start learned the first "
            f"{len(sample.retrieved):,})"
        )
    print(
        f"workload {workload.name}: {len(workload.requests):,} requests, "
        f"{len(workload.corpus):,} documents, {_RETRIEVERS[args.retriever]} top-{args.k}, "
        f"mode {args.mode}{arrival}"
    )
    print(engine_line)
    print()
    closing = ("upper-bound", CLAIRVOYANT_ARRIVAL)  # the references close the table
    shown = [r for r in results if r.method not in closing and not is_online_bound(r.method)]
    shown += ([offline] if offline else []) + [w.result for w in window_results]
    shown += [r for r in results if is_online_bound(r.method)]
    shown += [r for r in results if r.method == CLAIRVOYANT_ARRIVAL]
    shown += [r for r in results if r.method == "upper-bound"]
    rows = summarize(shown)
    real_model.add_answer_columns(rows, run)
    print(format_table(rows))
    print()
    window_rows: list[dict[str, Any]] = []
    if windows:
        window_rows = _print_windows(run, results, offline, window_results)
    for line in prefill_check(rows):
        print(line)
    for line in clairvoyant_check(rows, args.mode):
        print(line)
    for line in notes:
        print(line)
    for r in results:
        if r.method == "contextpilot":
            per_request = 1000 * r.plan_seconds / max(len(r.records), 1)
            print(f"contextpilot planning: {r.plan_seconds:.3f} s ({per_request:.3f} ms/request)")
    name = workload.name if args.retriever == "bm25" else f"{workload.name}-{args.retriever}"
    if args.out:
        out = [*results, *([offline] if offline else [])]
        print(f"wrote {write_json(args.out, run, out, window_results, window_rows)}")
    if not args.no_plot and windows:
        replay = "-replay" if args.arrival == "replay" else ""
        plot_path = args.plot or f"results/{name}-window{replay}{setup.plot_suffix}.png"
        references = _references(results, offline)
        title = f"{name}, planning window, {args.arrival} arrivals, k={args.k}\n{setup.plot_label}"
        print(f"wrote {plot_window_tradeoff(plot_path, window_rows, title, references)}")
    elif not args.no_plot:
        plot_path = args.plot or f"results/{name}-{args.mode}{setup.plot_suffix}.png"
        title = f"{name}, {args.mode}, k={args.k}, {setup.plot_label}"
        if "answer_scores" in run:
            print(f"wrote {real_model.plot_answers(plot_path, results, run, title)}")
        else:
            print(f"wrote {plot_results(plot_path, results, title)}")
    return 0


def _references(results: Sequence[MethodResult], offline: MethodResult | None) -> dict[str, float]:
    """The hit ratios a window is compared with: offline, online without a window, baseline."""
    by_name = {r.method: r.hit_ratio for r in results}
    references = {"offline": offline.hit_ratio} if offline else {}
    if "contextpilot" in by_name:
        references["online, no window"] = by_name["contextpilot"]
    if "baseline" in by_name:
        references["baseline"] = by_name["baseline"]
    return references


def _print_windows(
    run: dict[str, Any],
    results: Sequence[MethodResult],
    offline: MethodResult | None,
    window_results: Sequence[WindowResult],
) -> list[dict[str, Any]]:
    """Print the planning-window table and the target; returns its rows."""
    baseline = next((r for r in results if r.method == "baseline"), None)
    cache = run.get("cache_tokens_arg")  # the embedded model's only
    rows = summarize_windows(
        window_results,
        baseline_prefill=baseline.prefill_tokens if baseline else None,
        offline_hit_ratio=offline.hit_ratio if offline else None,
        target_applies=cache is not None and parse_cache_tokens(cache) == WINDOW_TARGET_CACHE,
    )
    adaptive = "adaptive" if window_results[0].policy.adaptive else "fixed"
    print(
        f"planning windows ({adaptive} closing, at most {window_results[0].policy.max_batch} "
        f"requests each; added latency = wait for the window to close + its planning time):"
    )
    print(format_table(rows, WINDOW_COLUMNS))
    if offline is not None:
        sizes = ", ".join(f"{r['requests_per_window']:.1f}" for r in rows if r["window_ms"] > 0)
        print(
            f"target: hit ratio >= {WINDOW_TARGET_VS_OFFLINE:g} of the offline figure "
            f"({offline.hit_ratio:.4f}) and added p50 <= the window, for a cache of "
            f"{WINDOW_TARGET_CACHE:g} and about 16 requests arriving per window (this run: "
            f"cache {cache}, {sizes} requests per window)"
        )
    print()
    return rows
