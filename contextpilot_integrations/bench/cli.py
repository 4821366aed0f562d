"""``contextpilot-bench``: run the methods side by side on a real workload and report.

With no arguments: MultiHop-RAG (500 questions), offline (one batch, ContextPilot's schedule),
BM25 top-10, on the embedded prefix-cache model with a capacity of 5% of the workload's unique
block tokens; prints the table and writes ``results/multihop-rag-offline.png``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from contextpilot_integrations.bench.engine_client import EngineClient, EngineError, OpenAIEngine
from contextpilot_integrations.bench.methods import (
    METHODS,
    MODES,
    EmbeddedEngine,
    Engine,
    parse_cache_tokens,
    prepare_workload,
    resolve_cache_tokens,
    run_methods,
)
from contextpilot_integrations.bench.report import (
    format_table,
    plot_results,
    summarize,
    write_json,
)
from contextpilot_integrations.bench.workloads import DATA_DIR_ENV, load_workload, workload_names
from contextpilot_integrations.core.blocks import (
    ApproxTokenCounter,
    TokenCounter,
    TokenizerCounter,
)

__all__ = ["build_parser", "main"]

DEFAULT_CACHE_TOKENS = "0.05"


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
        "--mode",
        choices=MODES,
        default="offline",
        help="offline: the workload is one batch (plan_batch + schedule); online: one request "
        "at a time in arrival order",
    )
    parser.add_argument(
        "--cache-tokens",
        default=None,
        help="embedded cache capacity: an int is tokens, a decimal (0.05) a fraction of the "
        f"workload's unique block tokens, 'unlimited' no limit (default {DEFAULT_CACHE_TOKENS})",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=1,
        help="embedded engine's KV block size: hits count in whole blocks (vLLM: 16)",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, from {', '.join(METHODS)} (default: all)",
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
    return parser


def _load_tokenizer(path: str) -> TokenizerCounter:
    if not Path(path).is_file():
        raise FileNotFoundError(f"--tokenizer: {path} does not exist")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            "--tokenizer needs the 'tokenizers' package (pip install tokenizers)"
        ) from None
    return TokenizerCounter(Tokenizer.from_file(path))


def _parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ValueError(f"--methods is empty: {text!r}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    return methods


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code (0 on success, 2 on bad input or
    missing data, 1 when a real engine fails)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # bm25s sets its own logger to DEBUG, which would bypass the level chosen here.
    logging.getLogger("bm25s").setLevel(level)
    try:
        return _run(args)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"contextpilot-bench: error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"contextpilot-bench: engine error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    methods = _parse_methods(args.methods)
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    counter: TokenCounter = tokenizer if tokenizer is not None else ApproxTokenCounter()
    workload = load_workload(args.workload, args.data_dir).head(args.limit)
    started = time.perf_counter()
    prepared = prepare_workload(workload, args.k, counter=counter)
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    run: dict[str, object] = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "documents": len(workload.corpus),
        "k": args.k,
        "mode": args.mode,
        "methods": methods,
        "token_counter": repr(counter) if tokenizer is None else f"tokenizer {args.tokenizer}",
        "unique_block_tokens": prepared.unique_block_tokens,
    }
    client: EngineClient | None = None
    if args.engine_url:
        if args.cache_tokens is not None:
            logging.getLogger(__name__).warning(
                "--cache-tokens is ignored with --engine-url: the engine's memory decides"
            )
        client = EngineClient(args.engine_url, model=args.model, api_key=args.api_key)
        engine_client = client

        def engine_factory() -> Engine:
            engine_client.flush_cache()
            return OpenAIEngine(engine_client, prepared.layout)

        run.update(engine=args.engine_url, model=client.model)
        engine_line = f"engine: {args.engine_url} (model {client.model})"
    else:
        spec = parse_cache_tokens(args.cache_tokens or DEFAULT_CACHE_TOKENS)
        capacity = resolve_cache_tokens(spec, prepared.unique_block_tokens)
        run.update(
            engine="embedded",
            cache_tokens_arg=args.cache_tokens or DEFAULT_CACHE_TOKENS,
            cache_tokens=capacity,
            block_size=args.block_size,
        )
        engine_factory = _embedded_factory(capacity, counter, tokenizer, args.block_size)
        if capacity is None:
            size = "unlimited"
        elif isinstance(spec, float):
            size = (
                f"{capacity:,} tokens ({spec:g} of {prepared.unique_block_tokens:,} unique "
                "block tokens)"
            )
        else:
            size = f"{capacity:,} tokens"
        engine_line = (
            f"engine: embedded prefix-cache model, capacity {size}, block size {args.block_size}"
        )
    try:
        results = run_methods(
            methods,
            prepared,
            mode=args.mode,
            engine_factory=engine_factory,
            block_size=args.block_size if client is None else 1,
            progress=progress,
        )
    finally:
        if client is not None:
            client.close()
    run["seconds"] = round(time.perf_counter() - started, 3)

    print(
        f"workload {workload.name}: {len(workload.requests):,} requests, "
        f"{len(workload.corpus):,} documents, BM25 top-{args.k}, mode {args.mode}"
    )
    print(engine_line)
    print()
    print(format_table(summarize(results)))
    print()
    for r in results:
        if r.method == "contextpilot":
            per_request = 1000 * r.plan_seconds / max(len(r.records), 1)
            print(f"contextpilot planning: {r.plan_seconds:.3f} s ({per_request:.3f} ms/request)")
    if args.out:
        print(f"wrote {write_json(args.out, run, results)}")
    if not args.no_plot:
        plot_path = args.plot or f"results/{workload.name}-{args.mode}.png"
        title = f"{workload.name}, {args.mode}, k={args.k}, {engine_line.removeprefix('engine: ')}"
        print(f"wrote {plot_results(plot_path, results, title)}")
    return 0


def _embedded_factory(
    capacity: int | None,
    counter: TokenCounter,
    tokenizer: TokenizerCounter | None,
    block_size: int,
) -> Callable[[], Engine]:
    def factory() -> Engine:
        return EmbeddedEngine(capacity, counter=counter, tokenizer=tokenizer, block_size=block_size)

    return factory
