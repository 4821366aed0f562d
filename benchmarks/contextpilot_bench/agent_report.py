"""``contextpilot-bench --workload agentic-multihop-rag | agentic-mtrag | agentic-file-edits``:
the agent replays' tables and targets.

Runs the LangChain methods (:mod:`~contextpilot_bench.agent_replay`), the LlamaIndex ones
(:mod:`~contextpilot_bench.agent_llamaindex`, skipped with a printed note when they cannot be
imported) and the hosted Anthropic ones over the same sessions, then prints per session and in
total: model calls, prompt tokens, prefill tokens on an unlimited prefix cache and on one of
5% of the baseline's unique tokens, the ratio to the plain agent's, pointers, dangling pointers
and prefix breaks (:mod:`~contextpilot_bench.agent_accounting`), the Anthropic input cost
(base-price tokens: ``input + 1.25 * writes + 0.1 * reads``, the 5-minute prices), and the
targets with ok / MISSED. With the LangChain methods the table has a ``proxy`` row too: the
plain agent's prompts planned in process by the proxy mode's own planning
(:mod:`~contextpilot_bench.agent_proxy`), what an unmodified agent sends through
``contextpilot-server --upstream``, held to within :data:`PROXY_MATCH_TARGET` of the
middleware's ratio; beside it the same prompts sent round-robin to two proxy processes that
plan as one (:mod:`~contextpilot_bench.proxy_processes`), their hit ratio held to at least
:data:`PEERS_TARGET` of one process's, and to two that know nothing of each other (the
contrast); on a search workload, the same conversations as a RAG app that marks its documents
in the body, through one, two peers and two unaware proxies
(:mod:`~contextpilot_bench.rag_proxy`). With ``--engine vllm-cpu`` the non-hosted methods'
prompts are also sent to vLLM's CPU build (:mod:`~contextpilot_bench.agent_engine`; with the
plain LangChain agent's sent once more through the proxy mode, the ``proxy`` row), and its
table and targets are the engine's own figures. With ``--engine vllm-cpu --engine-model
smollm2`` (a search workload, the LangChain agents) SmolLM2 answers each method's answer calls
instead and the answers are scored against the plain agent's
(:mod:`~contextpilot_bench.agent_answers`; the engine's prefill figures are the random-weights
run's).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contextpilot_bench.agent_accounting import (
    AgentPrompt,
    anthropic_usage,
    dangling_pointers,
    pointer_count,
    prefill_tokens,
    prefix_breaks,
    unique_tokens,
)
from contextpilot_bench.agent_answers import answer_lines, answer_on_smollm2
from contextpilot_bench.agent_engine import PROXY_METHOD, engine_rows, replay_on_vllm
from contextpilot_bench.agent_file_sessions import FILE_WORKLOAD, file_sessions
from contextpilot_bench.agent_llamaindex import (
    LLAMAINDEX_AGENT_METHODS,
    llamaindex_unavailable,
    replay_llamaindex,
)
from contextpilot_bench.agent_proxy import plan_through_proxy
from contextpilot_bench.agent_replay import (
    ANTHROPIC_MODEL,
    HOSTED_AGENT_METHODS,
    LANGCHAIN_AGENT_METHODS,
    AgentRun,
    replay_langchain,
)
from contextpilot_bench.agent_sessions import (
    TOP_K,
    AgentSession,
    agent_sessions,
    source_workload,
)
from contextpilot_bench.proxy_processes import send_through_peers
from contextpilot_bench.rag_proxy import UNIT_CHARS, rag_rows
from contextpilot_bench.real_model import scores_answers
from contextpilot_bench.report import format_table
from contextpilot_bench.retrieval import ScopedBM25
from contextpilot_bench.vllm_setup import VLLM_ENGINE
from contextpilot_bench.workloads import load_workload
from contextpilot_integrations.core.blocks import ApproxTokenCounter, TokenCounter
from contextpilot_integrations.llm_call.provider_minimums import anthropic_min_cacheable_tokens

__all__ = [
    "AGENT_FAMILIES",
    "DEFAULT_AGENT_SESSIONS",
    "PREFILL_TARGETS",
    "agent_rows",
    "run_agent_report",
]

AGENT_FAMILIES = ("langchain", "llamaindex", "hosted-anthropic")
"""``--agents`` values: which replays run."""
DEFAULT_AGENT_SESSIONS = {"agentic-multihop-rag": 8, "agentic-mtrag": 32, FILE_WORKLOAD: 8}
"""``--agent-sessions`` by workload: the first N sessions."""
PREFILL_TARGETS = {"agentic-multihop-rag": 0.80, "agentic-mtrag": 0.50, FILE_WORKLOAD: 0.80}
"""ContextPilot's prefill tokens at most this share of the plain agent's (unlimited cache)."""
LLAMAINDEX_TARGET = 0.60
"""The LlamaIndex ``FunctionAgent``'s, on agentic MTRAG-UN."""
HOSTED_TARGET = 0.80
"""ContextPilot's Anthropic input cost at most this share of
``AnthropicPromptCachingMiddleware``'s."""
PROXY_MATCH_TARGET = 0.02
"""The proxy's engine prefill ratio within this of ContextPilotMiddleware's."""
PEERS_TARGET = 0.95
"""Two proxy processes' hit ratio at least this share of one process's (unlimited cache)."""
PEERS_METHOD, UNPINNED_METHOD = "proxy-2-peers", "proxy-2-unpinned"
"""Two proxy processes, calls round-robin: peers (the owner rule), and unaware of each other."""
PRICE_WRITE, PRICE_READ, TTL_S = 1.25, 0.1, 300.0
SMALL_CACHE = 0.05
"""The small cache: this share of the baseline's unique tokens."""

_COLUMNS = [
    ("method", "method", "str"),
    ("calls", "calls", "int"),
    ("prompt tokens", "prompt_tokens", "int"),
    ("prefill tokens", "prefill_tokens", "int"),
    ("vs baseline", "prefill_vs_baseline", "ratio"),
    ("prefill @5%", "prefill_small_cache", "int"),
    ("vs baseline @5%", "small_vs_baseline", "ratio"),
    ("pointers", "pointers", "int"),
    ("dangling", "dangling", "int"),
    ("prefix breaks", "prefix_breaks", "int"),
]
_SESSION_COLUMNS = [
    ("session", "session", "str"),
    ("method", "method", "str"),
    ("calls", "calls", "int"),
    ("prompt tokens", "prompt_tokens", "int"),
    ("prefill tokens", "prefill_tokens", "int"),
    ("vs baseline", "prefill_vs_baseline", "ratio"),
    ("dangling", "dangling", "int"),
    ("prefix breaks", "prefix_breaks", "int"),
]
_ENGINE_COLUMNS = [
    ("method", "method", "str"),
    ("calls", "calls", "int"),
    ("prompt tokens", "prompt_tokens", "int"),
    ("cached tokens", "cached_tokens", "int"),
    ("prefill tokens", "prefill_tokens", "int"),
    ("vs baseline", "prefill_vs_baseline", "ratio"),
    ("TTFT p50 s", "ttft_p50_s", "s"),
    ("prefix breaks", "prefix_breaks", "int"),
    ("sessions broken", "sessions_with_breaks", "int"),
]
_PROCESS_COLUMNS = [
    ("method", "method", "str"),
    ("processes", "processes", "int"),
    ("calls", "calls", "int"),
    ("prompt tokens", "prompt_tokens", "int"),
    ("prefill tokens", "prefill_tokens", "int"),
    ("hit ratio", "hit_ratio", "ratio"),
    ("vs one process", "hit_vs_one", "ratio"),
    ("prefix breaks", "prefix_breaks", "int"),
    ("dangling", "dangling", "int"),
]
_HOSTED_COLUMNS = [
    ("method", "method", "str"),
    ("prompt tokens", "prompt_tokens", "int"),
    ("cache reads", "cache_read_tokens", "int"),
    ("cache writes", "cache_write_tokens", "int"),
    ("input", "input_tokens", "int"),
    ("input cost", "input_cost", "f1"),
    ("vs caching mw", "cost_vs_caching", "ratio"),
    ("dangling", "dangling", "int"),
    ("prefix breaks", "prefix_breaks", "int"),
]


def _baseline_of(method: str) -> str:
    return "llamaindex-baseline" if method.startswith("llamaindex") else "baseline"


def _figures(
    prompts: Sequence[AgentPrompt], dangling: Sequence[int], counter: TokenCounter, small: int
) -> dict[str, Any]:
    """The figures of ``prompts`` served in order on fresh caches (``dangling``: per prompt)."""
    served = prefill_tokens(prompts, counter, None)
    last: dict[str, AgentPrompt] = {p.session: p for p in prompts}
    return {
        "calls": len(prompts),
        "prompt_tokens": sum(t for t, _ in served),
        "prefill_tokens": sum(p for _, p in served),
        "prefill_small_cache": sum(p for _, p in prefill_tokens(prompts, counter, small)),
        "pointers": sum(pointer_count(p) for p in last.values()),
        "dangling": sum(dangling),
        "prefix_breaks": len(prefix_breaks(prompts)),
    }


def agent_rows(
    runs: Sequence[AgentRun], counter: TokenCounter
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(total rows, session rows)``: one per method, and per method and session (the
    non-hosted runs; ratios against the run's own framework's baseline). A method's sessions
    share one cache in its total row; a session row is that session alone on a fresh cache."""
    base_run = next((r for r in runs if r.method == "baseline"), runs[0])
    small = max(1, round(SMALL_CACHE * unique_tokens(base_run.prompts, counter)))
    totals: list[dict[str, Any]] = []
    sessions: list[dict[str, Any]] = []
    for run in runs:
        dangling = [len(dangling_pointers(p, run.originals[p.session])) for p in run.prompts]
        totals.append({"method": run.method, **_figures(run.prompts, dangling, counter, small)})
        by_session: dict[str, list[int]] = {}
        for position, prompt in enumerate(run.prompts):
            by_session.setdefault(prompt.session, []).append(position)
        for session, positions in by_session.items():
            own = [run.prompts[i] for i in positions]
            row: dict[str, Any] = {"session": session, "method": run.method}
            row.update(_figures(own, [dangling[i] for i in positions], counter, small))
            sessions.append(row)
    for rows, key in ((totals, ()), (sessions, ("session",))):
        index = {(r["method"], *(r[k] for k in key)): r for r in rows}
        for row in rows:
            base = index.get((_baseline_of(row["method"]), *(row[k] for k in key)))
            row["prefill_vs_baseline"] = (
                row["prefill_tokens"] / base["prefill_tokens"]
                if base and base["prefill_tokens"]
                else None
            )
            row["small_vs_baseline"] = (
                row["prefill_small_cache"] / base["prefill_small_cache"]
                if base and base["prefill_small_cache"]
                else None
            )
    return totals, sessions


def process_rows(
    runs: Sequence[tuple[AgentRun, int]], counter: TokenCounter
) -> list[dict[str, Any]]:
    """One row per ``(run, processes)`` on an unlimited prefix cache: hit ratio (cached
    tokens over prompt tokens) and its ratio to the first run's (one process)."""
    rows: list[dict[str, Any]] = []
    for run, processes in runs:
        served = prefill_tokens(run.prompts, counter, None)
        prompt = sum(t for t, _ in served)
        prefill = sum(p for _, p in served)
        rows.append(
            {
                "method": run.method,
                "processes": processes,
                "calls": len(run.prompts),
                "prompt_tokens": prompt,
                "prefill_tokens": prefill,
                "hit_ratio": 1 - prefill / prompt if prompt else None,
                "prefix_breaks": len(prefix_breaks(run.prompts)),
                "dangling": sum(
                    len(dangling_pointers(p, run.originals[p.session])) for p in run.prompts
                ),
            }
        )
    one = rows[0]["hit_ratio"] if rows else None
    for row in rows:
        hit = row["hit_ratio"]
        row["hit_vs_one"] = hit / one if hit is not None and one else None
    return rows


def hosted_rows(runs: Sequence[AgentRun], counter: TokenCounter) -> list[dict[str, Any]]:
    """One row per hosted method: Anthropic usage and input cost (module docstring)."""
    minimum = anthropic_min_cacheable_tokens(ANTHROPIC_MODEL)
    rows: list[dict[str, Any]] = []
    for run in runs:
        usage = anthropic_usage(run.prompts, counter, min_tokens=minimum, ttl_s=TTL_S)
        reads = sum(u.cache_read_tokens for u in usage)
        writes = sum(u.cache_write_tokens or 0 for u in usage)
        inputs = sum(u.input_tokens for u in usage)
        rows.append(
            {
                "method": run.method,
                "prompt_tokens": sum(u.prompt_tokens for u in usage),
                "cache_read_tokens": reads,
                "cache_write_tokens": writes,
                "input_tokens": inputs,
                "input_cost": round(inputs + PRICE_WRITE * writes + PRICE_READ * reads, 1),
                "dangling": sum(
                    len(dangling_pointers(p, run.originals[p.session])) for p in run.prompts
                ),
                "prefix_breaks": len(prefix_breaks(run.prompts)),
            }
        )
    base = next((r["input_cost"] for r in rows if r["method"] == "anthropic-caching"), None)
    for row in rows:
        row["cost_vs_caching"] = row["input_cost"] / base if base else None
    return rows


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return f"n/a (target <= {target})"
    return f"{value:.3f} (target <= {target}: {'ok' if value <= target else 'MISSED'})"


def _match(value: float | None, reference: float | None) -> str:
    """``value`` against ``reference`` and their difference, with :data:`PROXY_MATCH_TARGET`."""
    target = f"target within {PROXY_MATCH_TARGET}"
    if value is None or reference is None:
        return f"n/a ({target})"
    difference = value - reference
    verdict = "ok" if abs(difference) <= PROXY_MATCH_TARGET else "MISSED"
    return f"{value:.3f} vs {reference:.3f}, difference {difference:+.3f} ({target}: {verdict})"


def _parse_families(text: str | None) -> list[str]:
    if text is None:
        return list(AGENT_FAMILIES)
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in chosen if t not in AGENT_FAMILIES]
    if bad or not chosen:
        raise ValueError(f"--agents takes values from {', '.join(AGENT_FAMILIES)}, got {text!r}")
    return chosen


def _llamaindex_verdict(name: str, row: dict[str, Any]) -> str:
    """The LlamaIndex agent's prefill ratio of ``row``, judged on the workload its target is
    for."""
    ratio = row["prefill_vs_baseline"]
    if name == "agentic-mtrag" or ratio is None:
        return _verdict(ratio, LLAMAINDEX_TARGET)
    return f"{ratio:.3f} (the target is for agentic-mtrag)"


def _engine_report(
    name: str, runs: Sequence[AgentRun], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Send ``runs`` to vLLM CPU and print its table and targets; ``(rows, settings)``."""
    if not runs:
        raise ValueError(
            f"--engine {VLLM_ENGINE} sends the langchain and llamaindex methods' prompts; "
            f"--agents {args.agents} chose none"
        )
    started = time.perf_counter()
    served, settings = replay_on_vllm(runs, args)
    rows = engine_rows(served, settings["block_size"])
    capacity = settings["kv_cache_tokens"]
    print(
        f"\nvLLM CPU ({VLLM_ENGINE}, random weights, max_tokens=1), engine-reported usage: block "
        f"size {settings['block_size']}, max_model_len {settings['max_model_len']:,} (longest "
        f"prompt {settings['longest_prompt_tokens']:,}), KV cache "
        + (f"{capacity:,} tokens" if capacity is not None else "of unknown size")
        + f" ({settings['kv_cache_gib']} GiB); each method's prompts in call order, session "
        f"after session, on an emptied prefix cache; started in {settings['startup_seconds']:.1f}"
        f" s, {time.perf_counter() - started:.1f} s in all"
    )
    print(format_table(rows, _ENGINE_COLUMNS))
    print()
    by_method = {r["method"]: r for r in rows}
    if "contextpilot" in by_method:
        print(
            "contextpilot prefill tokens vs the plain agent's (vLLM CPU, engine-reported) = "
            + _verdict(by_method["contextpilot"]["prefill_vs_baseline"], PREFILL_TARGETS[name])
        )
    if PROXY_METHOD in by_method and "contextpilot" in by_method:
        print(
            "proxy prefill tokens vs ContextPilotMiddleware's (vLLM CPU, engine-reported): "
            + _match(
                by_method[PROXY_METHOD]["prefill_vs_baseline"],
                by_method["contextpilot"]["prefill_vs_baseline"],
            )
        )
    if "llamaindex-contextpilot" in by_method:
        verdict = _llamaindex_verdict(name, by_method["llamaindex-contextpilot"])
        print(
            "llamaindex-contextpilot prefill tokens vs the plain FunctionAgent's (vLLM CPU, "
            f"engine-reported) = {verdict}"
        )
    breaks = sum(r["prefix_breaks"] for r in rows)
    print(
        "engine prefix breaks (cached tokens short of the previous call's prompt in whole "
        f"blocks): {breaks} (target 0: {'ok' if breaks == 0 else 'MISSED'})"
    )
    return rows, settings


def _answers_report(
    name: str, sessions: Sequence[AgentSession], runs: Sequence[AgentRun], args: argparse.Namespace
) -> dict[str, Any]:
    """Generate SmolLM2's answers to the runs' answer calls, print their scores and the
    no-collapse targets; the JSON document (:mod:`~contextpilot_bench.agent_answers`)."""
    print()
    lines, document = answer_lines(name, answer_on_smollm2(runs, sessions, args), args.data_dir)
    print("\n".join(lines))
    return document


def _share_verdict(value: float | None) -> str:
    """``value`` (a hit ratio's share of one process's) against :data:`PEERS_TARGET`."""
    if value is None:
        return f"n/a (target >= {PEERS_TARGET})"
    return f"{value:.3f} (target >= {PEERS_TARGET}: {'ok' if value >= PEERS_TARGET else 'MISSED'})"


def _print_processes(prows: Sequence[dict[str, Any]], rag: Sequence[dict[str, Any]]) -> None:
    """The proxy over processes: the agent table, the RAG one, the targets (two peers' hit
    ratio at least :data:`PEERS_TARGET` of one process's)."""
    if not prows:
        return
    print(
        f"\n{PROXY_METHOD} over processes (the plain agent's prompts, call i to process i mod n "
        f"as a round-robin balancer sends them; unlimited cache): {PEERS_METHOD} over HTTP "
        f"with the peer rule, {UNPINNED_METHOD} planned by two that know nothing of each other"
    )
    print(format_table(prows, _PROCESS_COLUMNS))
    peers = next(r for r in prows if r["method"] == PEERS_METHOD)["hit_vs_one"]
    print(f"{PEERS_METHOD} hit ratio vs one process's (unlimited cache) = {_share_verdict(peers)}")
    if not rag:
        return
    print(
        "\nthe same conversations as a RAG app marking each turn's documents in the body "
        f"(contextpilot.documents, BM25 top-{TOP_K}), through the same processes; "
        f"prefix-cache units of {UNIT_CHARS} characters, unlimited cache:"
    )
    print(format_table(rag, _PROCESS_COLUMNS[:7]))
    for row in rag:
        if row["method"].endswith("(peers)"):
            print(
                f"{row['method']} hit ratio vs one process's = {_share_verdict(row['hit_vs_one'])}"
            )


def run_agent_report(args: argparse.Namespace) -> int:
    """Run the agent replays ``args`` choose and print the tables and targets; 0 on success."""
    name = args.workload
    families = _parse_families(args.agents)
    if scores_answers(args) and (
        args.engine != VLLM_ENGINE or name == FILE_WORKLOAD or "langchain" not in families
    ):
        raise ValueError(
            f"--engine-model {args.engine_model} scores the answers of the plain LangChain agent "
            "and the library's against the data's references: it needs --engine "
            f"{VLLM_ENGINE}, the langchain agents and a search workload (agentic-mtrag or "
            f"agentic-multihop-rag), got --engine {args.engine}, --agents {args.agents}, "
            f"--workload {name}"
        )
    count = DEFAULT_AGENT_SESSIONS[name] if args.agent_sessions is None else args.agent_sessions
    if args.tokenizer:
        from contextpilot_bench.engine_setups import load_tokenizer

        counter: TokenCounter = load_tokenizer(args.tokenizer)
    else:
        counter = ApproxTokenCounter()
    index: ScopedBM25 | None = None
    if name == FILE_WORKLOAD:
        sessions = file_sessions(count)
        shape = "file reads, an edit, a re-read"
    else:
        workload = load_workload(source_workload(name), args.data_dir)
        sessions = agent_sessions(name, workload, count)
        index = ScopedBM25(workload)
        shape = f"2 searches (BM25 top-{TOP_K})"
    started = time.perf_counter()
    runs: list[AgentRun] = []
    proxied: list[AgentRun] = []  # planned from the baseline's prompts: never sent again
    spread: list[tuple[AgentRun, int]] = []  # the proxy row again over two processes
    if "langchain" in families:
        runs += [replay_langchain(m, sessions, index) for m in LANGCHAIN_AGENT_METHODS]
        baseline = next(r for r in runs if r.method == "baseline")
        proxied.append(plan_through_proxy(baseline))
        spread = [
            (proxied[0], 1),
            (send_through_peers(baseline, 2, PEERS_METHOD), 2),
            (plan_through_proxy(baseline, 2, UNPINNED_METHOD), 2),
        ]
    note = None
    if "llamaindex" in families:
        note = llamaindex_unavailable()
        if note is None:
            runs += [replay_llamaindex(m, sessions, index) for m in LLAMAINDEX_AGENT_METHODS]
    hosted = (
        [replay_langchain(m, sessions, index) for m in HOSTED_AGENT_METHODS]
        if "hosted-anthropic" in families
        else []
    )
    turns = sum(len(s.turns) for s in sessions)
    print(
        f"workload {name}: {len(sessions)} sessions, {turns} user turns, {shape} and an "
        f"answer per turn; scripted models, {counter!r}; replayed in "
        f"{time.perf_counter() - started:.1f}s"
    )
    totals, per_session = agent_rows([*runs, *proxied], counter) if runs else ([], [])
    if runs:
        print()
        print(format_table(per_session, _SESSION_COLUMNS))
        print()
        print(format_table(totals, _COLUMNS))
    if note is not None:
        print(f"\nLlamaIndex FunctionAgent skipped: {note}")
    hrows = hosted_rows(hosted, counter) if hosted else []
    if hrows:
        print(
            f"\nhosted Anthropic ({ANTHROPIC_MODEL}, minimum cacheable "
            f"{anthropic_min_cacheable_tokens(ANTHROPIC_MODEL):,} tokens, 5m TTL, write "
            f"{PRICE_WRITE}x, read {PRICE_READ}x the base input price):"
        )
        print(format_table(hrows, _HOSTED_COLUMNS))
    print()
    by_method = {r["method"]: r for r in totals}
    target = PREFILL_TARGETS[name]
    if "contextpilot" in by_method:
        print(
            "contextpilot prefill tokens vs the plain agent's (unlimited cache) = "
            + _verdict(by_method["contextpilot"]["prefill_vs_baseline"], target)
        )
    if PROXY_METHOD in by_method and "contextpilot" in by_method:
        print(
            f"{PROXY_METHOD} (the plain agent's prompts planned in process by the proxy mode) "
            "prefill tokens vs ContextPilotMiddleware's (unlimited cache): "
            + _match(
                by_method[PROXY_METHOD]["prefill_vs_baseline"],
                by_method["contextpilot"]["prefill_vs_baseline"],
            )
        )
    if "llamaindex-contextpilot" in by_method:
        verdict = _llamaindex_verdict(name, by_method["llamaindex-contextpilot"])
        print(f"llamaindex-contextpilot prefill tokens vs the plain FunctionAgent's = {verdict}")
    prows = process_rows(spread, counter)
    rag = rag_rows(sessions, index, counter) if index is not None and spread else []
    _print_processes(prows, rag)

    checked = [*totals, *hrows, *(r for r in prows if r["method"] == PEERS_METHOD)]
    dangling = sum(r["dangling"] for r in checked)
    breaks = sum(r["prefix_breaks"] for r in checked)
    print(f"dangling pointers: {dangling} (target 0: {'ok' if dangling == 0 else 'MISSED'})")
    print(f"prefix breaks: {breaks} (target 0: {'ok' if breaks == 0 else 'MISSED'})")
    for row in hrows:
        if row["method"].startswith("contextpilot"):
            print(
                f"{row['method']} Anthropic input cost vs AnthropicPromptCachingMiddleware's = "
                + _verdict(row["cost_vs_caching"], HOSTED_TARGET)
            )
    engine: dict[str, Any] | None = None
    if args.engine == VLLM_ENGINE and scores_answers(args):
        print(
            "\nthe engine's prefill figures come from the random-weights model: the same "
            "command without --engine-model"
        )
        engine = {"answers": _answers_report(name, sessions, [*runs, *proxied], args)}
    elif args.engine == VLLM_ENGINE:
        rows, settings = _engine_report(name, runs, args)
        engine = {**settings, "totals": rows}
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"workload": name, "sessions": len(sessions), "totals": totals,
                   "per_session": per_session, "hosted": hrows, "engine": engine,
                   "proxy_processes": prows, "rag_proxy_processes": rag}  # fmt: skip
        path.write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")
    return 0
