"""The argument parser of ``contextpilot-bench`` and the defaults its help text names.

The options are documented here, in their ``help``, and the runs they choose in
:mod:`~contextpilot_bench.cli`. The defaults that depend on the workload or the
engine are ``None`` in the parsed arguments and filled in by the run
(:mod:`~contextpilot_bench.cli_option_values` and the runs' modules).
"""

from __future__ import annotations

import argparse

from contextpilot_bench.arrivals import ARRIVALS
from contextpilot_bench.methods import METHODS, MODES
from contextpilot_bench.multiturn import MULTITURN_METHODS
from contextpilot_bench.online_bounds import DEFAULT_LOOKAHEADS
from contextpilot_bench.prepared_conversations import RETRIEVAL_QUERIES
from contextpilot_bench.proxy_fleet import DEFAULT_PROXY_HOLD_MS, ProxySettings
from contextpilot_bench.replica_model import parse_replica_counts
from contextpilot_bench.vllm_setup import (
    DEFAULT_BLOCK_SIZE,
    VLLM_ENGINE,
    add_vllm_arguments,
)
from contextpilot_bench.workloads import AGENT_WORKLOADS, DATA_DIR_ENV, workload_names
from contextpilot_integrations.core.window.window_policy import WindowPolicy

__all__ = [
    "DEFAULT_CACHE_TOKENS",
    "DEFAULT_MULTITURN_CACHE_TOKENS",
    "DEFAULT_WINDOWS_MS",
    "DEFAULT_WINDOW_POLICY",
    "build_parser",
]

DEFAULT_CACHE_TOKENS = "0.05"
"""``--cache-tokens`` for a single-turn workload: 5% of its unique block tokens."""
DEFAULT_MULTITURN_CACHE_TOKENS = "unlimited"
"""``--cache-tokens`` for a multi-turn workload."""
DEFAULT_WINDOWS_MS = "0,5,10,20,50"
"""``--window-ms`` with ``--arrival``: one run per planning-window length, in ms."""
DEFAULT_WINDOW_POLICY = WindowPolicy()
"""The core's planning-window policy, whose ``max_batch`` and ``adaptive`` are the defaults of
``--max-batch`` and ``--window-adaptive``."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``contextpilot-bench``."""
    parser = argparse.ArgumentParser(
        prog="contextpilot-bench",
        description=(
            "Replay a real RAG workload through a prefix cache and compare the baseline "
            "(retriever order), ContextPilot and the upper bound."
        ),
    )
    parser.add_argument(
        "--workload", choices=[*workload_names(), *AGENT_WORKLOADS], default="multihop-rag"
    )
    parser.add_argument(
        "--data-dir",
        help=(
            f"dataset directory (default: ${DATA_DIR_ENV}, else the datasets fetched from their "
            'upstreams into the cache (see docs/DESIGN.md, "Datasets"))'
        ),
    )
    parser.add_argument(
        "-k", "--top-k", dest="k", type=_count, default=10, help="blocks per request"
    )
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
        default=None,
        help="offline (default): the workload is one batch (plan_batch + schedule); online: one "
        "request at a time in arrival order (a multi-turn workload is always planned turn by "
        "turn; a hosted engine always online)",
    )
    parser.add_argument(
        "--arrival",
        choices=ARRIVALS,
        help="with --mode online: plan the requests in planning windows as they arrive; "
        "poisson: a seeded Poisson process of --rate requests per second, in the workload's "
        "order; replay: at the times the workload records (mtrag: when each user turn was "
        "written), gaps scaled to --rate when given. Virtual time, nothing sleeps",
    )
    parser.add_argument(
        "--rate",
        help="with --arrival: requests per second, one value or one per --window-ms value "
        "(e.g. 3200,1600,800 for about 16 requests per 5, 10, 20 ms window)",
    )
    parser.add_argument(
        "--window-ms",
        help="with --arrival: planning-window lengths in ms, comma-separated, one run each; "
        f"0 plans each request alone, as --mode online (default {DEFAULT_WINDOWS_MS})",
    )
    parser.add_argument(
        "--proxy-max-in-flight",
        type=int,
        default=None,
        metavar="N",
        help="--engine vllm-cpu, contextpilot-proxy-smg: the proxy's calls out at once per "
        "replica (its door, sent in schedule order; 0: no cap; default 4)",
    )
    parser.add_argument(
        "--proxy-window-hold-ms",
        type=float,
        default=None,
        metavar="MS",
        help="--engine vllm-cpu, contextpilot-proxy-smg: the proxy holds a planning window "
        "open up to MS ms past its length while every replica has calls waiting at its door "
        f"(0: never; default {DEFAULT_PROXY_HOLD_MS:g} with a window)",
    )
    parser.add_argument(
        "--proxy-target-workers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--engine vllm-cpu, contextpilot-proxy-smg: the proxy sends each call to its "
        "replica's worker by SMG's worker index (smg under consistent_hashing; default), or "
        "by the routing key alone (smg under round_robin, --no-proxy-target-workers)",
    )
    parser.add_argument(
        "--proxy-kv-capacity",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--engine vllm-cpu, contextpilot-proxy-smg: the proxy learns each replica's KV "
        'capacity from its engine (kv_capacity_tokens "auto": its indexes drop what the '
        "cache can no longer hold at planning time; default), or not (--no-proxy-kv-capacity: "
        "null, nothing asked)",
    )
    parser.add_argument(
        "--window-adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --arrival: close a window at half its length while no two of its requests "
        f"share a block (the core's rule; default {DEFAULT_WINDOW_POLICY.adaptive})",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        help="with --arrival: most requests in one window "
        f"(default {DEFAULT_WINDOW_POLICY.max_batch}; the proxy's window of --replicas N "
        f"--engine vllm-cpu: {ProxySettings.window_max_batch})",
    )
    parser.add_argument(
        "--seed", type=int, help="with --arrival poisson: the arrival process's seed (default 0)"
    )
    parser.add_argument(
        "--warm-start",
        choices=("half",),
        help="single-turn workloads without --arrival: every method serves the second half of "
        "the requests (by arrival), and ContextPilot is also run warm-started on the first half "
        "(learned, not indexed or sent), beside clairvoyant-arrival of the second half",
    )
    parser.add_argument(
        "--online-bounds",
        nargs="?",
        const=",".join(str(k) for k in DEFAULT_LOOKAHEADS),
        metavar="K,...",
        help="with --mode online on a single-turn workload: also run the references that say "
        "what part of the gap to clairvoyant-arrival an online planner could close: "
        "ContextPilot warm-started on the very requests it serves (oracle history) and an "
        "aligner that knows the next K requests, one run per K (default "
        f"{','.join(str(k) for k in DEFAULT_LOOKAHEADS)})",
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
    parser.add_argument("--limit", type=_count, help="only the first N requests")
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
    replicas = parser.add_argument_group("engine replicas (--replicas)")
    replicas.add_argument(
        "--replicas",
        type=_replica_counts,
        help="comma-separated replica counts, e.g. 1,2,8,32: the embedded model compares, per "
        "count, baseline prompts via SMG's round_robin, cache_aware and prefix_hash, ContextPilot "
        "prompts via cache_aware and ContextPilot routing, the total --cache-tokens split "
        "evenly over the replicas (default online); with --engine vllm-cpu: N real replicas",
    )
    replicas.add_argument(
        "--router",
        choices=("smg", "direct"),
        help="with --engine vllm-cpu --replicas: ContextPilot's routing through SMG's routing "
        "key, or straight to the chosen replica's URL",
    )
    replicas.add_argument(
        "--gateway-in-flight",
        type=int,
        help="with --replicas (embedded): requests in flight per replica, the load the gateway "
        "models count (default 4)",
    )
    agents = parser.add_argument_group(
        "agent replays (--workload agentic-multihop-rag | agentic-mtrag | agentic-file-edits)"
    )
    agents.add_argument(
        "--agents",
        help="comma-separated, from langchain (create_agent: the plain agent against "
        "ContextPilotMiddleware + retriever_tool), llamaindex (FunctionAgent against "
        "ContextPilotAgentLLM; skipped with a note when it cannot be imported), "
        "hosted-anthropic (Anthropic input cost: AnthropicPromptCachingMiddleware against "
        "ContextPilotMiddleware(engine='anthropic')); default all. Scripted models, two BM25 "
        "top-5 searches and an answer per user turn, cache model unlimited and 5%%; with "
        f"--engine {VLLM_ENGINE} the langchain and llamaindex prompts are also sent to vLLM's "
        "CPU build (random weights, a tool-aware chat template, a cache that holds them all), "
        "the plain LangChain agent's once more with the openai SDK through the proxy mode "
        "(contextpilot-server --upstream; the proxy row), and the engine's reported prefill "
        "tokens, median TTFT and prefix breaks printed",
    )
    agents.add_argument(
        "--agent-sessions",
        type=_count,
        help="the first N sessions (default 8 for agentic-multihop-rag, 4 questions each; 32 "
        "for agentic-mtrag, one conversation each; 8 for agentic-file-edits, 5 turns each)",
    )
    hosted = parser.add_argument_group("hosted APIs (--engine hosted-anthropic | hosted-openai)")
    hosted.add_argument(
        "--price-write",
        type=float,
        help="cache-write price as a multiple of the base input price (Anthropic publishes 1.25 "
        "for 5-minute writes, 2 for 1-hour ones); required with hosted-anthropic",
    )
    hosted.add_argument(
        "--price-read",
        type=float,
        help="cache-read price as a multiple of the base input price (Anthropic publishes 0.1); "
        "required with a hosted engine",
    )
    hosted.add_argument(
        "--hosted-model",
        help="the model id, for its minimum cacheable length (hosted-anthropic; default: "
        "unknown, 1,024 tokens)",
    )
    hosted.add_argument(
        "--hosted-min-tokens",
        type=int,
        help="the minimum cacheable prefix in tokens, instead of the model's",
    )
    hosted.add_argument(
        "--cache-ttl",
        choices=("5m", "1h"),
        default="5m",
        help="hosted-anthropic: the breakpoints' cache lifetime (default 5m)",
    )
    hosted.add_argument(
        "--prompt-cache-retention",
        choices=("in_memory", "24h"),
        help="hosted-openai: passed through; the model keeps the in-memory lifetime",
    )
    return parser


def _replica_counts(text: str) -> list[int]:
    """``--replicas`` for argparse, which shows an ``ArgumentTypeError``'s message (a
    ``ValueError`` it reports by the function's name)."""
    try:
        return parse_replica_counts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    """An int >= 1 (``-k``, ``--limit``, ``--agent-sessions``; argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value
