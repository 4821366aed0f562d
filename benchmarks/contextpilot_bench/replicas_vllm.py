"""``contextpilot-bench --engine vllm-cpu --replicas N --router smg|direct``: N real vLLM CPU
replicas behind the real Shepherd Model Gateway, the methods of
:mod:`~contextpilot_bench.vllm_replica_methods` on one workload.

1. The workload is retrieved (BM25 top-k) and counted with the model's tokenizer, as the
   single-engine run does (:mod:`~contextpilot_bench.vllm_setup`); random weights.
2. The total KV cache is ``--engine-kv-tokens`` (tokens, or a fraction of the workload's unique
   block tokens) in whole blocks; each replica gets 1/N of it, raised where that is less than
   one request of ``max_model_len`` tokens (the report says so: then the fleet holds more than
   the total asked).
3. N servers start (:class:`~contextpilot_bench.vllm_replica_fleet.VllmCpuFleet`),
   are warmed up, and each method runs on emptied caches behind a gateway of its own
   (``smg launch`` on loopback, :mod:`~contextpilot_bench.smg_gateway`;
   ``scripts/setup-smg-env.sh``).
   Requests go one at a time, or with ``--arrival poisson --rate R`` (``--seed``) at those
   arrival times, at most ``MAX_USERS`` in flight, the same times for every method (a rate far
   above the fleet's, 10000, sends the workload as one batch of concurrent calls); the proxy
   method's proxy plans in windows of ``--window-ms`` (default
   :data:`DEFAULT_PROXY_WINDOW_MS` with ``--arrival``, else 0), each held open while every
   replica has calls waiting at the proxy's door, up to ``--proxy-window-hold-ms`` (default
   :data:`~contextpilot_bench.proxy_fleet.DEFAULT_PROXY_HOLD_MS` with a window).
4. The table: engine hit ratio in total and per replica, requests and prompt tokens per replica
   with max/min, TTFT p50/p90, and the same stream on one paged model of the fleet's total KV
   (:mod:`~contextpilot_bench.vllm_replica_report`); with the proxy method, its arrivals and
   window replayed on one replica of the total KV and on the fleet's replicas (the window
   model, :mod:`~contextpilot_bench.windowed_fleet_model`: the proxy's same-arrival
   denominator); the targets; ``--out``
   writes it all as JSON, per request included.

Everything started is stopped on exit, on errors, on Ctrl-C and SIGTERM (each server's and each
gateway's process group).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from contextpilot_bench.arrivals import Arrivals, arrivals_for
from contextpilot_bench.cli_option_values import parse_numbers, proxy_options_given
from contextpilot_bench.kv_cache_size import max_model_len_for, size_kv_cache
from contextpilot_bench.methods import prepare_workload
from contextpilot_bench.proxy_fleet import DEFAULT_PROXY_HOLD_MS, ProxySettings
from contextpilot_bench.report import format_table
from contextpilot_bench.vllm_replica_methods import (
    MAX_USERS,
    PROXY_METHOD,
    ReplicaMethodRun,
    methods_for,
    run_vllm_replica_method,
)
from contextpilot_bench.vllm_replica_report import (
    VLLM_REPLICA_COLUMNS,
    vllm_replica_rows,
    vllm_replica_target_lines,
)
from contextpilot_bench.windowed_fleet_model import WindowedFleetRun, run_windowed_fleet_model
from contextpilot_bench.workloads import load_workload
from contextpilot_integrations.core.window.planning_window import MAX_WINDOW_MS

__all__ = ["DEFAULT_PROXY_WINDOW_MS", "replica_blocks", "run_vllm_replicas"]

DEFAULT_PROXY_WINDOW_MS = 100.0
"""The proxy's planning window with ``--arrival`` (milliseconds)."""


def replica_blocks(total_blocks: int, replicas: int, minimum_blocks: int) -> tuple[int, bool]:
    """Usable KV blocks of each of ``replicas`` sharing ``total_blocks``: the ceiling of the
    share, raised to ``minimum_blocks`` (one request of ``max_model_len``). Returns
    ``(blocks, raised)``."""
    share = math.ceil(total_blocks / replicas)
    return max(share, minimum_blocks), share < minimum_blocks


def _check(args: argparse.Namespace) -> int:
    """The replica count, after refusing options that do not apply.

    Raises:
        ValueError: more than one ``--replicas`` value, fewer than 2, or an option of another
            engine or workload.
    """
    counts = list(args.replicas)
    if len(counts) != 1 or counts[0] < 2:
        raise ValueError(
            f"--engine vllm-cpu --replicas takes one count >= 2 (real servers), got {counts}"
        )
    if getattr(args, "engine_model", "random") != "random":
        raise ValueError("--replicas with --engine vllm-cpu runs the random-weights model only")
    if args.engine_url or args.cache_tokens is not None:
        raise ValueError("--replicas with --engine vllm-cpu: drop --engine-url/--cache-tokens")
    if args.mode == "online":
        raise ValueError(
            "--replicas with --engine vllm-cpu: drop --mode online (--arrival poisson sends the "
            "requests at arrival times)"
        )
    if args.window_adaptive is not None:
        raise ValueError(
            "--replicas with --engine vllm-cpu: the proxy's window takes the core's "
            "adaptive rule; drop --window-adaptive"
        )
    if args.arrival is None and (args.rate is not None or args.seed is not None):
        raise ValueError("--rate and --seed need --arrival poisson")
    if args.block_size <= 0 or args.block_size % 32:
        raise ValueError(f"--block-size must be a positive multiple of 32, got {args.block_size}")
    return counts[0]


def _proxy_window_ms(args: argparse.Namespace) -> float:
    """The proxy's planning window: one ``--window-ms`` value.

    Raises:
        ValueError: more than one value, or a negative one.
    """
    if args.window_ms is None:
        return DEFAULT_PROXY_WINDOW_MS if args.arrival is not None else 0.0
    values = parse_numbers(args.window_ms, "--window-ms", positive=False)
    if len(values) != 1:
        raise ValueError(
            f"--window-ms with --replicas --engine vllm-cpu is the proxy's one window, got "
            f"{args.window_ms!r}"
        )
    return float(values[0])


def _sending(arrivals: Arrivals | None) -> str:
    if arrivals is None:
        return "one at a time"
    return (
        f"at Poisson arrival times ({arrivals.rate_per_s:g}/s, {arrivals.times_s[-1]:.2f} s "
        f"from first to last), at most {MAX_USERS} in flight"
    )


def _proxy_hold_ms(args: argparse.Namespace, window_ms: float) -> float:
    """How long the proxy may hold its window while the replicas are busy:
    ``--proxy-window-hold-ms``, by default :data:`DEFAULT_PROXY_HOLD_MS` with a window and 0
    without one.

    Raises:
        ValueError: a negative or too long value, or a hold without a window.
    """
    given = getattr(args, "proxy_window_hold_ms", None)
    if given is None:
        return DEFAULT_PROXY_HOLD_MS if window_ms > 0 else 0.0
    if not 0 <= given <= MAX_WINDOW_MS:
        raise ValueError(
            f"--proxy-window-hold-ms must be from 0 to {MAX_WINDOW_MS:g}, got {given:g}"
        )
    if given > 0 and window_ms == 0:
        raise ValueError(
            f"--proxy-window-hold-ms {given:g} holds the proxy's planning window, and "
            "--window-ms is 0 (no window): give --window-ms > 0 too"
        )
    return float(given)


def _cap(max_in_flight: int | None) -> str:
    if max_in_flight is None:
        return "no cap on calls in flight per replica"
    return f"at most {max_in_flight} in flight per replica"


def _proxy_line(run: ReplicaMethodRun) -> str | None:
    """What the proxy's router and window did (the proxy method), for the report."""
    figures = run.router
    if run.method != PROXY_METHOD or figures is None:
        return None
    window = figures.get("window")
    planned = (
        f"window {figures['window_ms']:g} ms: {window['windows']} windows, "
        f"{window['requests']} calls, mean batch {window['mean_batch']:.1f} (at most "
        f"{figures['window_max_batch']}), "
        f"{window['batch_failures']} batches planned again one by one, "
        f"{window['held']} held while every replica had calls waiting at its door "
        f"({window['held_ms'] / 1000:.1f} s in all, at most {figures['window_hold_ms']:g} ms "
        "each)"
        if window
        else "no window: each call planned alone"
    )
    door = figures.get("door")
    sent = (
        f"; sent {'in schedule order' if door['ordered'] else 'as they came'}, "
        f"{_cap(door['max_in_flight'])} ({door['waited']} calls waited at the "
        f"door, {door['stale']} stale tickets)"
        if door
        else ""
    )
    workers = figures.get("workers")
    targeted = (
        f"; gateway workers targeted: {workers['state']} {workers['workers']}"
        f"{' (' + workers['reason'] + ')' if workers['reason'] else ''}, "
        f"{workers['misrouted']} targeted calls missed their worker"
        if workers
        else ""
    )
    capacity = figures.get("kv_capacity_tokens")
    budgets = [r.get("kv_budget") for r in figures["replicas"].values()]
    known = (
        f"; replicas' KV capacity learnt from the engines ({capacity:,} tokens each: "
        f"{sum(b['dropped'] for b in budgets if b)} requests dropped from the indexes at "
        f"planning time)"
        if capacity
        else "; replicas' KV capacity not known"
    )
    return (
        f"{PROXY_METHOD}: the proxy's {planned}; router load {figures['load']}, "
        f"max_imbalance {figures['max_imbalance']:g}, {figures['remapped']} requests re-mapped"
        f"{known}{sent}{targeted}"
    )


def run_vllm_replicas(args: argparse.Namespace) -> int:
    """Run the replicas benchmark (module docstring); returns the exit code (0).

    Raises:
        ValueError, FileNotFoundError: bad options, no vLLM Python or no ``smg``.
        EngineError: a replica or the gateway failed a request.
    """
    from tokenizers import Tokenizer

    from contextpilot_bench.testbed.chat_template import tokenize_prompt
    from contextpilot_bench.testbed.locations import require_smg, require_vllm_python
    from contextpilot_bench.testbed.model_dir import ensure_model_dir
    from contextpilot_bench.vllm_replica_fleet import VllmCpuFleet
    from contextpilot_integrations.core.blocks import TokenizerCounter

    if args.block_size is None:
        args.block_size = 32
    count = _check(args)
    methods = methods_for(args.router or "smg", args.methods)
    proxy_options = proxy_options_given(args)
    if proxy_options and PROXY_METHOD not in methods:
        raise ValueError(
            f"{', '.join(proxy_options)}: options of the {PROXY_METHOD} method, which "
            f"--methods {','.join(methods)} does not run"
        )
    cap = getattr(args, "proxy_max_in_flight", None)
    cap = 4 if cap is None else cap
    if cap < 0:
        raise ValueError(f"--proxy-max-in-flight must be >= 0 (0: no cap), got {cap}")
    known_capacity = getattr(args, "proxy_kv_capacity", None) is not False
    window_ms = _proxy_window_ms(args)
    settings = ProxySettings(
        window_ms=window_ms,
        max_in_flight=cap or None,
        window_hold_ms=_proxy_hold_ms(args, window_ms),
        window_max_batch=args.max_batch or ProxySettings.window_max_batch,
        target_workers=getattr(args, "proxy_target_workers", None) is not False,
    )
    python = require_vllm_python(args.engine_python)
    smg = str(require_smg(getattr(args, "smg_binary", None)))
    model_dir = ensure_model_dir(args.engine_model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    started = time.perf_counter()
    workload = load_workload(args.workload, args.data_dir).head(args.limit)
    prepared = prepare_workload(workload, args.k, counter=TokenizerCounter(tokenizer))
    arrivals = None
    if args.arrival is not None:
        rate = parse_numbers(args.rate, "--rate", positive=True)[0] if args.rate else None
        arrivals = arrivals_for(args.arrival, workload, rate, args.seed or 0)
    max_model_len, longest = max_model_len_for(
        prepared,
        lambda messages: tokenize_prompt(tokenizer, messages),
        args.block_size,
        int(config["max_position_embeddings"]),
    )
    max_model_len = args.engine_max_model_len or max_model_len
    total = size_kv_cache(
        args.engine_kv_tokens, prepared.unique_block_tokens, args.block_size, max_model_len
    )
    if total.usable_blocks is None:
        raise ValueError("--replicas with --engine vllm-cpu needs a sized --engine-kv-tokens")
    minimum = -(-max_model_len // args.block_size)
    per_replica, raised = replica_blocks(total.usable_blocks, count, minimum)
    if not known_capacity:  # the proxy learns it from the engines unless told not to
        settings = replace(settings, kv_capacity_tokens=None)
    fleet_tokens = per_replica * args.block_size * count
    run: dict[str, Any] = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "k": args.k,
        "engine": "vllm-cpu",
        "replicas": count,
        "router": args.router or "smg",
        "methods": methods,
        "sending": _sending(arrivals),
        "proxy_window_ms": settings.window_ms,
        "model_dir": str(model_dir),
        "block_size": args.block_size,
        "max_model_len": max_model_len,
        "longest_prompt_tokens": longest,
        "kv_total": {**asdict(total), "num_gpu_blocks": total.num_gpu_blocks},
        "replica_usable_blocks": per_replica,
        "replica_raised_to_one_request": raised,
        "fleet_kv_tokens": fleet_tokens,
        "cores": os.cpu_count(),
        "load_average_start": os.getloadavg(),
    }
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    with VllmCpuFleet(
        model_dir,
        count,
        block_size=args.block_size,
        num_gpu_blocks=per_replica + 1,
        max_model_len=max_model_len,
        vllm_python=python,
        startup_timeout=args.engine_startup_timeout,
    ) as fleet:
        run["startup_seconds"] = round(time.perf_counter() - started, 3)
        print(
            f"{count} vLLM CPU replicas ready ({', '.join(fleet.urls)}), "
            f"{per_replica} KV blocks each",
            file=sys.stderr,
            flush=True,
        )
        warm = [
            prepared.layout.render_messages(prepared.block_texts(i), r.query)
            for i, r in enumerate(prepared.workload.requests[:2])
        ]
        run["warm_up_seconds"] = round(fleet.warm_up(warm), 3)
        runs = []
        for method in methods:
            tick = _progress(method, len(workload.requests)) if progress else None
            runs.append(
                run_vllm_replica_method(
                    method, prepared, fleet, smg_binary=smg, progress=tick, arrivals=arrivals,
                    proxy_settings=settings,
                )
            )  # fmt: skip
            done = runs[-1]
            prompt = sum(r.prompt_tokens for r in done.requests)
            cached = sum(r.cached_tokens for r in done.requests)
            print(
                f"{chr(10) if progress else ''}{method}: engine hit "
                f"{cached / max(prompt, 1):.4f} in {done.seconds:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    run["seconds"] = round(time.perf_counter() - started, 3)
    run["load_average_end"] = os.getloadavg()
    rows = vllm_replica_rows(runs, total_capacity_tokens=fleet_tokens, block_size=args.block_size)
    models: list[WindowedFleetRun] = []
    if PROXY_METHOD in methods:
        # The proxy's fair denominator: its arrivals and window on one replica of the total KV
        # (and on the fleet's replicas, served one at a time in schedule order); pipelined,
        # each window planned before the previous one is served, with and without the
        # replicas' KV capacity known.
        variants = [
            (replicas, pipelined, known)
            for pipelined, known in ((False, known_capacity), (True, True), (True, False))
            for replicas in (1, count)
        ]
        for replicas, pipelined, known in variants:
            capacity = fleet_tokens if replicas == 1 else per_replica * args.block_size
            models.append(
                run_windowed_fleet_model(
                    prepared,
                    arrivals or _one_at_a_time(len(workload.requests)),
                    settings.window_ms,
                    max_batch=settings.window_max_batch,
                    replicas=replicas,
                    capacity_tokens=capacity,
                    block_size=args.block_size,
                    tokenize=lambda messages: tokenize_prompt(tokenizer, messages),
                    known_capacity=known,
                    pipelined=pipelined,
                )
            )
        run["same_arrival_window_model"] = [
            {**asdict(m), "hit_ratio": m.hit_ratio, "mean_batch": m.mean_batch} for m in models
        ]
    note = " (raised to hold one request: the fleet holds more than asked)" if raised else ""
    print(
        f"workload {workload.name}: {len(workload.requests):,} requests, BM25 top-{args.k}, "
        f"sent {_sending(arrivals)}; load average {run['load_average_start'][0]:.1f} at the "
        f"start, {run['load_average_end'][0]:.1f} at the end"
    )
    print(
        f"engine: {count} x vLLM CPU ({config['num_hidden_layers']}-layer/"
        f"{config['hidden_size']} Llama, random weights), block size {args.block_size}, "
        f"{per_replica} KV blocks each{note}; total asked: {total.describe()}; "
        f"max_model_len {max_model_len:,}; gateway smg (scripts/setup-smg-env.sh)"
    )
    print()
    print(format_table(rows, VLLM_REPLICA_COLUMNS))
    print()
    targets = vllm_replica_target_lines(
        rows, same_arrival_one_replica=models[0].hit_ratio if models else None
    )
    for line in targets:
        print(line)
    for done in runs:
        proxy_line = _proxy_line(done)
        if proxy_line is not None:
            print(proxy_line)
    if models:
        one = models[0]
        print(
            f"window model (the proxy's arrivals and window in virtual time, closed on time "
            f"and never held: {one.windows} windows, mean batch {one.mean_batch:.1f}; each "
            f"window planned by a ReplicaRouter "
            f"and served in schedule order on paged models of {one.capacity_tokens:,} tokens in "
            f"all):"
        )
        for single, fleet_model in zip(models[::2], models[1::2]):
            how = (
                "planned before the previous window is served"
                if single.pipelined
                else "served before the next window is planned"
            )
            capacity = "known" if single.known_capacity else "not known"
            print(
                f"  {how}, replicas' KV capacity {capacity}: one replica {single.hit_ratio:.4f}, "
                f"{count} replicas {fleet_model.hit_ratio:.4f} "
                f"({fleet_model.hit_ratio / max(single.hit_ratio, 1e-12):.2f} of one)"
            )
    print(
        f"one-replica model: the method's token stream on one paged prefix-cache model of "
        f"{fleet_tokens:,} tokens (the fleet's total KV); {run['seconds']:.0f} s in all"
    )
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        per_request = {
            r.method: [{k: v for k, v in asdict(x).items() if k != "token_ids"} for x in r.requests]
            for r in runs
        }
        workers = {r.method: {n: asdict(w) for n, w in r.workers.items()} for r in runs}
        payload = {
            "run": run,
            "rows": rows,
            "targets": targets,
            "workers": workers,
            "requests": per_request,
        }
        path.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
        print(f"wrote {path}")
    return 0


def _one_at_a_time(n: int) -> Arrivals:
    """Requests sent one at a time, as arrivals: a second apart (each its own window)."""
    return Arrivals("replay", tuple(range(n)), np.arange(n, dtype=np.float64), 1.0)


def _progress(method: str, total: int) -> Any:
    done = [0]

    def tick() -> None:
        done[0] += 1
        print(f"\r{method}: {done[0]}/{total}", end="", file=sys.stderr, flush=True)

    return tick
