"""``contextpilot-bench --replicas 1,2,8,32``: the embedded multi-replica comparison, reported.

Runs :func:`~contextpilot_bench.replica_model.compare_replicas` on the workload
(single-turn: MultiHop-RAG, MTRAG, ...) with the embedded model's capacity options
(``--cache-tokens`` is the *total* capacity, split evenly over the replicas) and prints, per
replica count, a table (hit ratio in total and its range over the replicas, requests and prompt
tokens per replica as max/min) and the targets:

- ContextPilot routing / the one-replica ContextPilot at the same total capacity >=
  :data:`TARGET_VS_ONE_REPLICA`;
- ContextPilot routing / ContextPilot prompts through ``cache_aware`` >= :data:`TARGET_VS_BLIND`;
- ContextPilot routing / baseline prompts through ``cache_aware`` >= :data:`TARGET_VS_BASELINE`;
- ContextPilot routing's max/min prompt tokens per replica <= :data:`TARGET_BALANCE`.

``--out`` writes the rows, the targets and each run's per-replica figures as JSON; the plot
(``--plot``, default ``results/<workload>-replicas.png``; ``--no-plot``) draws hit ratio against
the replica count, one line per method and the one-replica reference.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contextpilot_bench.engine_setups import EmbeddedSetup
from contextpilot_bench.methods import MODES, prepare_workload
from contextpilot_bench.multiturn import MULTITURN_WORKLOADS
from contextpilot_bench.replica_model import (
    BLIND,
    DEFAULT_IN_FLIGHT_PER_REPLICA,
    ONE_REPLICA,
    REPLICA_METHODS,
    ROUTING,
    ReplicaRun,
    compare_replicas,
)
from contextpilot_bench.report import format_table
from contextpilot_bench.workloads import load_workload

__all__ = [
    "REPLICA_COLUMNS",
    "TARGET_BALANCE",
    "TARGET_VS_BASELINE",
    "TARGET_VS_BLIND",
    "TARGET_VS_ONE_REPLICA",
    "plot_replica_scaling",
    "replica_rows",
    "replica_targets",
    "run_embedded_replicas",
]

logger = logging.getLogger(__name__)

TARGET_VS_ONE_REPLICA = 0.9
TARGET_VS_BLIND = 1.3
TARGET_VS_BASELINE = 3.0
TARGET_BALANCE = 1.3
BASELINE_CACHE_AWARE = "baseline cache_aware"


def _max_over_min(values: Sequence[int]) -> float | None:
    return max(values) / min(values) if values and min(values) > 0 else None


def replica_rows(reference: ReplicaRun, runs: Mapping[int, Sequence[ReplicaRun]]) -> list[dict]:
    """One row per (replica count, method), the reference first.

    Returns:
        Dicts with ``replicas, method, requests, prompt_tokens, cached_tokens, hit_ratio,
        vs_one_replica, replica_hit_min, replica_hit_max`` (over replicas that served
        something), ``requests_max_over_min, tokens_max_over_min`` (None when a replica
        served nothing) and ``capacity_per_replica``.
    """
    rows = []
    for run in [reference, *(r for n in runs for r in runs[n])]:
        hits = [h for h in run.hit_ratio_per_replica if h is not None]
        rows.append(
            {
                "replicas": run.replicas,
                "method": run.method,
                "requests": len(run.result.records),
                "prompt_tokens": run.result.prompt_tokens,
                "cached_tokens": run.result.cached_tokens,
                "hit_ratio": run.hit_ratio,
                "vs_one_replica": run.hit_ratio / reference.hit_ratio
                if reference.hit_ratio
                else None,
                "replica_hit_min": min(hits, default=None),
                "replica_hit_max": max(hits, default=None),
                "requests_max_over_min": _max_over_min(run.requests_per_replica),
                "tokens_max_over_min": _max_over_min(run.prompt_tokens_per_replica),
                "capacity_per_replica": run.capacity_per_replica,
            }
        )
    return rows


REPLICA_COLUMNS = (
    ("replicas", "replicas", "int"),
    ("method", "method", "str"),
    ("prompt tokens", "prompt_tokens", "int"),
    ("cached tokens", "cached_tokens", "int"),
    ("hit ratio", "hit_ratio", "ratio"),
    ("vs 1 replica", "vs_one_replica", "ratio"),
    ("replica hit min", "replica_hit_min", "ratio"),
    ("replica hit max", "replica_hit_max", "ratio"),
    ("requests max/min", "requests_max_over_min", "ratio"),
    ("tokens max/min", "tokens_max_over_min", "ratio"),
)
"""Columns of :func:`~.report.format_table` for :func:`replica_rows`."""


def replica_targets(reference: ReplicaRun, runs: Sequence[ReplicaRun]) -> dict[str, Any]:
    """The target ratios for one replica count (``runs``: its methods' runs).

    Returns:
        ``{"routing_vs_one_replica", "routing_vs_blind_cache_aware",
        "routing_vs_baseline_cache_aware", "routing_tokens_max_over_min"}`` (None where a
        method is missing or hit nothing), and ``met``: name -> bool for those computed.
    """
    by_name = {r.method: r for r in runs}
    routing = by_name.get(ROUTING)
    ratios: dict[str, float | None] = dict.fromkeys(
        (
            "routing_vs_one_replica",
            "routing_vs_blind_cache_aware",
            "routing_vs_baseline_cache_aware",
            "routing_tokens_max_over_min",
        )
    )
    if routing is not None:

        def over(other: ReplicaRun | None) -> float | None:
            return routing.hit_ratio / other.hit_ratio if other and other.hit_ratio else None

        ratios["routing_vs_one_replica"] = over(reference)
        ratios["routing_vs_blind_cache_aware"] = over(by_name.get(BLIND))
        ratios["routing_vs_baseline_cache_aware"] = over(by_name.get(BASELINE_CACHE_AWARE))
        ratios["routing_tokens_max_over_min"] = _max_over_min(routing.prompt_tokens_per_replica)
    bounds = {
        "routing_vs_one_replica": (TARGET_VS_ONE_REPLICA, True),
        "routing_vs_blind_cache_aware": (TARGET_VS_BLIND, True),
        "routing_vs_baseline_cache_aware": (TARGET_VS_BASELINE, True),
        "routing_tokens_max_over_min": (TARGET_BALANCE, False),
    }
    met = {
        name: (value >= bounds[name][0]) if bounds[name][1] else (value <= bounds[name][0])
        for name, value in ratios.items()
        if value is not None
    }
    return {**ratios, "met": met}


def _target_lines(n: int, targets: Mapping[str, Any]) -> list[str]:
    def show(name: str, label: str, bound: str) -> str:
        value = targets[name]
        if value is None:
            return f"  {label}: n/a ({bound})"
        verdict = "ok" if targets["met"][name] else "MISSED"
        return f"  {label}: {value:.3f} ({bound}: {verdict})"

    lines = [f"targets at {n} replica(s):"]
    lines.append(show("routing_vs_one_replica", "CP routing / one-replica CP", ">= 0.9"))
    lines.append(show("routing_vs_blind_cache_aware", "CP routing / CP via cache_aware", ">= 1.3"))
    lines.append(
        show("routing_vs_baseline_cache_aware", "CP routing / baseline via cache_aware", ">= 3")
    )
    lines.append(show("routing_tokens_max_over_min", "CP routing prompt tokens max/min", "<= 1.3"))
    return lines


def plot_replica_scaling(
    path: str | Path,
    reference: ReplicaRun,
    runs: Mapping[int, Sequence[ReplicaRun]],
    title: str,
) -> Path:
    """Save a PNG: hit ratio against the replica count (log-2 axis), one line per method, the
    one-replica ContextPilot as a dashed line and 0.9 of it dotted. Parent directories are
    created; matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = sorted(runs)
    methods = [m for m in REPLICA_METHODS if any(r.method == m for n in runs for r in runs[n])]
    fig, axis = plt.subplots(figsize=(8, 5))
    for i, method in enumerate(methods):
        points = [(n, r.hit_ratio) for n in counts for r in runs[n] if r.method == method]
        axis.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            "o-" if method == ROUTING else "s--" if method.startswith("contextpilot") else "^:",
            color=f"C{i}",
            label=method,
        )
    axis.axhline(reference.hit_ratio, color="black", linestyle="--", label=ONE_REPLICA)
    axis.axhline(
        TARGET_VS_ONE_REPLICA * reference.hit_ratio,
        color="grey",
        linestyle=":",
        label=f"target: {TARGET_VS_ONE_REPLICA:g} x {ONE_REPLICA}",
    )
    axis.set_xscale("log", base=2)
    axis.set_xticks(counts, [str(n) for n in counts])
    axis.set_xlabel("replicas (same total KV capacity, 1/N each)")
    axis.set_ylabel("cache hit ratio (cached / prompt tokens)")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize="small")
    axis.set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write_json(
    path: str | Path,
    run: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    targets: Mapping[int, Mapping[str, Any]],
    reference: ReplicaRun,
    runs: Mapping[int, Sequence[ReplicaRun]],
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    detail = [
        {
            "replicas": r.replicas,
            "method": r.method,
            "capacity_per_replica": r.capacity_per_replica,
            "plan_seconds": r.result.plan_seconds,
            "requests_per_replica": r.requests_per_replica,
            "prompt_tokens_per_replica": r.prompt_tokens_per_replica,
            "cached_tokens_per_replica": r.cached_tokens_per_replica,
            "hit_ratio_per_replica": r.hit_ratio_per_replica,
            "routing": r.routing,
        }
        for r in [reference, *(x for n in runs for x in runs[n])]
    ]
    document = {
        "run": dict(run),
        "summary": list(rows),
        "targets": {str(n): dict(t) for n, t in targets.items()},
        "runs": detail,
    }
    path.write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def run_embedded_replicas(args: argparse.Namespace, default_cache: str) -> int:
    """The ``--replicas`` run on the embedded model (module docstring); returns 0.

    Raises:
        ValueError: a multi-turn workload, ``--engine-url``, ``--arrival``, a retriever other
            than BM25, or bad ``--methods``.
    """
    if args.workload in MULTITURN_WORKLOADS:
        raise ValueError(f"--replicas takes a single-turn workload, not {args.workload}")
    for option, given in (
        (f"--engine {args.engine}", args.engine not in ("embedded", None)),
        ("--engine-url", args.engine_url),
        ("--arrival", args.arrival),
        ("--retriever mem0", args.retriever != "bm25"),
    ):
        if given:
            raise ValueError(f"{option} does not apply to the embedded --replicas comparison")
    mode = args.mode or "online"
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {MODES}")
    methods = list(REPLICA_METHODS)
    if args.methods:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in REPLICA_METHODS]
        if unknown:
            raise ValueError(f"--methods: unknown {unknown}; choose from {list(REPLICA_METHODS)}")
    in_flight = args.gateway_in_flight or DEFAULT_IN_FLIGHT_PER_REPLICA
    setup = EmbeddedSetup(args, default_cache)
    started = time.perf_counter()
    workload = load_workload(args.workload, args.data_dir).head(args.limit)
    prepared = prepare_workload(workload, args.k, counter=setup.counter)
    run: dict[str, Any] = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "k": args.k,
        "mode": mode,
        "replicas": args.replicas,
        "methods": methods,
        "gateway_in_flight_per_replica": in_flight,
        "token_counter": setup.counter_description,
        "unique_block_tokens": prepared.unique_block_tokens,
    }
    engine_line = setup.start(prepared, run)
    reference, runs = compare_replicas(
        prepared,
        args.replicas,
        setup.capacity,
        methods=methods,
        progress=logger.info,
        counter=setup.counter,
        tokenizer=setup.tokenizer,
        block_size=setup.block_size,
        mode=mode,
        in_flight_per_replica=in_flight,
    )
    run["seconds"] = round(time.perf_counter() - started, 3)
    print(
        f"workload {workload.name}: {len(workload.requests):,} requests, BM25 top-{args.k}, "
        f"mode {mode}; replicas {','.join(map(str, args.replicas))} share the total capacity"
    )
    print(f"{engine_line} (total; each replica gets 1/N)")
    print(f"gateway models (SMG defaults): {in_flight} requests in flight per replica")
    print()
    rows = replica_rows(reference, runs)
    print(format_table(rows, REPLICA_COLUMNS))
    print()
    targets = {n: replica_targets(reference, runs[n]) for n in runs}
    for n, figures in targets.items():
        if n == 1:
            print(
                "targets at 1 replica: n/a (every method is the one-replica ContextPilot's or "
                "the baseline's)"
            )
            continue
        for line in _target_lines(n, figures):
            print(line)
    print(f"time: {run['seconds']:.1f} s")
    if args.out:
        print(f"wrote {_write_json(args.out, run, rows, targets, reference, runs)}")
    if not args.no_plot:
        plot = args.plot or f"results/{workload.name}-replicas.png"
        capacity = engine_line.removeprefix("engine: embedded prefix-cache model, ")
        title = f"{workload.name}, {mode}, k={args.k}, total {capacity}"
        print(f"wrote {plot_replica_scaling(plot, reference, runs, title)}")
    sys.stdout.flush()
    return 0
