"""The multi-turn replay's figures (:mod:`~contextpilot_bench.multiturn`): one row
per method and session count, the table's columns, and the JSON.

The target: ``alignment+dedup``'s prefill tokens at most 0.6 of the baseline's at k=10 on an
unlimited cache. What bounds it: the history is already cached, so a turn's prefill is nearly
all its new blocks, and de-duplication can only remove the blocks an earlier turn of the same
conversation showed (:attr:`PreparedConversations.repeat_share
<contextpilot_bench.prepared_conversations.PreparedConversations.repeat_share>`). The target
needs about 40% of the retrieved tokens to repeat, which retrieval for the conversation so far
(``--retrieval-query conversation``) gives and retrieval for the new turn alone does not.
ContextPilot also finds turn-1 prefixes shared across conversations and sends a text retrieved
twice in one turn once. With a limited cache, round-robin sessions evict each other's histories
just before they are needed (LRU), so shorter histories keep more of them cached.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from contextpilot_bench.multiturn import MultiTurnResult
from contextpilot_bench.report import summarize

__all__ = ["MULTITURN_COLUMNS", "PREFILL_TARGET", "summarize_multiturn", "write_multiturn_json"]

PREFILL_TARGET = 0.6
"""The target: prefill tokens with de-duplication at most this share of the baseline's
(``mtrag-conversations``, k=10, unlimited cache)."""


def summarize_multiturn(results: Sequence[MultiTurnResult]) -> list[dict[str, Any]]:
    """One row per result, in order: :func:`~contextpilot_bench.report.summarize`'s
    figures plus ``sessions``, ``prefill_vs_baseline`` (prefill tokens over the baseline's with
    the same ``sessions``; ``None`` without one), ``plan_ms_median``, ``blocks_replaced``,
    ``sub_blocks_replaced`` and ``tokens_saved`` (``None`` for the baseline)."""
    rows = []
    baseline_prefill = {
        r.sessions: r.result.prefill_tokens for r in results if r.method == "baseline"
    }
    for r in results:
        row = summarize([r.result])[0]
        reference = baseline_prefill.get(r.sessions)
        row.pop("vs_upper_bound")
        row.pop("vs_baseline")
        row["sessions"] = r.sessions
        row["prefill_vs_baseline"] = r.result.prefill_tokens / reference if reference else None
        row["plan_ms_median"] = statistics.median(r.plan_ms) if r.plan_ms else None
        for key in ("blocks_replaced", "sub_blocks_replaced", "tokens_saved"):
            row[key] = r.dedup.get(key) if r.method != "baseline" else None
        rows.append(row)
    return rows


MULTITURN_COLUMNS = (
    ("method", "method", "str"),
    ("sessions", "sessions", "int"),
    ("requests", "requests", "int"),
    ("prompt tokens", "prompt_tokens", "int"),
    ("cached tokens", "cached_tokens", "int"),
    ("prefill tokens", "prefill_tokens", "int"),
    ("hit ratio", "hit_ratio", "ratio"),
    ("prefill vs baseline", "prefill_vs_baseline", "ratio"),
    ("plan ms p50", "plan_ms_median", "ms"),
    ("blocks replaced", "blocks_replaced", "int"),
    ("sub-blocks replaced", "sub_blocks_replaced", "int"),
)
"""Columns of :func:`~contextpilot_bench.report.format_table` for the rows of
:func:`summarize_multiturn`."""


def write_multiturn_json(
    path: str | Path, run: Mapping[str, Any], results: Sequence[MultiTurnResult]
) -> Path:
    """Write the run settings, the summary rows and every per-request record as JSON.

    Layout: ``{"run": {...}, "summary": [rows], "results": [{"method", "sessions",
    "plan_ms": [...], "dedup": {...}, "cache": {...} | null, "index": {...},
    "records": [{request_index, rid, prompt_tokens, cached_tokens, ttft_s}]}]}``; records in
    send order. Parent directories are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "run": dict(run),
        "summary": summarize_multiturn(results),
        "results": [
            {
                "method": r.method,
                "sessions": r.sessions,
                "plan_ms": r.plan_ms,
                "dedup": r.dedup,
                "evicted_from_index": r.evicted_from_index,
                "cache": asdict(r.result.cache) if r.result.cache is not None else None,
                "index": r.result.index,
                "records": [asdict(x) for x in r.result.records],
            }
            for r in results
        ],
    }
    path.write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")
    return path
