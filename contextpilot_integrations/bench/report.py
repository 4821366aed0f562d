"""Benchmark reports: a table for the terminal, JSON for machines, a PNG plot for people.

Figures per method (all token counts are prompt tokens):

* ``hit_ratio`` = cached tokens / prompt tokens (the paper's cache hit ratio);
* ``prefill_tokens`` = prompt tokens - cached tokens (what the engine computes);
* ``vs_upper_bound`` = hit ratio / the upper bound's hit ratio (same run);
* ``vs_baseline`` = hit ratio / the baseline's hit ratio (same run; ``None`` when the baseline
  hit nothing);
* with a real engine: TTFT mean, median and p99 in seconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from contextpilot_integrations.bench.methods import MethodResult

__all__ = ["format_table", "plot_results", "summarize", "write_json"]

BASELINE = "baseline"
UPPER_BOUND = "upper-bound"


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def summarize(results: Sequence[MethodResult]) -> list[dict[str, Any]]:
    """One row of figures per method, in the order of ``results``.

    Returns:
        Dicts with ``method, requests, prompt_tokens, cached_tokens, prefill_tokens,
        hit_ratio, vs_upper_bound, vs_baseline, plan_ms_per_request`` and, when the engine
        reported TTFT, ``ttft_mean_s, ttft_p50_s, ttft_p99_s``. A ratio is ``None`` when its
        reference method is not in the run or hit nothing.
    """
    by_name = {r.method: r for r in results}
    upper = by_name[UPPER_BOUND].hit_ratio if UPPER_BOUND in by_name else None
    base = by_name[BASELINE].hit_ratio if BASELINE in by_name else None
    rows = []
    for r in results:
        row: dict[str, Any] = {
            "method": r.method,
            "requests": len(r.records),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "prefill_tokens": r.prefill_tokens,
            "hit_ratio": r.hit_ratio,
            "vs_upper_bound": _ratio(r.hit_ratio, upper),
            "vs_baseline": _ratio(r.hit_ratio, base),
            "plan_ms_per_request": 1000 * r.plan_seconds / len(r.records) if r.records else 0.0,
        }
        ttfts = np.array([x.ttft_s for x in r.records if x.ttft_s is not None], dtype=float)
        if ttfts.size:
            row["ttft_mean_s"] = float(ttfts.mean())
            row["ttft_p50_s"] = float(np.percentile(ttfts, 50))
            row["ttft_p99_s"] = float(np.percentile(ttfts, 99))
        rows.append(row)
    return rows


_COLUMNS = (
    ("method", "method", "str"),
    ("requests", "requests", "int"),
    ("prompt tokens", "prompt_tokens", "int"),
    ("cached tokens", "cached_tokens", "int"),
    ("prefill tokens", "prefill_tokens", "int"),
    ("hit ratio", "hit_ratio", "ratio"),
    ("vs upper bound", "vs_upper_bound", "ratio"),
    ("vs baseline", "vs_baseline", "x"),
)


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if kind == "int":
        return f"{value:,}"
    if kind == "ratio":
        return f"{value:.4f}"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "s":
        return f"{value:.4f}"
    if kind == "ms":
        return f"{value:.3f}"
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]] | None = None
) -> str:
    """A fixed-width text table of :func:`summarize` rows (TTFT columns when present).

    Args:
        rows: the rows.
        columns: ``(title, row key, kind)`` per column, kind one of ``str``, ``int``,
            ``ratio``, ``x``, ``s``, ``ms``; default the columns of :func:`summarize`.
    """
    columns = list(columns) if columns is not None else list(_COLUMNS)
    if any("ttft_mean_s" in r for r in rows):
        columns += [("TTFT mean s", "ttft_mean_s", "s"), ("TTFT p50 s", "ttft_p50_s", "s")]
    cells = [[_fmt(r.get(key), kind) for _, key, kind in columns] for r in rows]
    widths = [
        max(len(title), *(len(c[i]) for c in cells)) for i, (title, _, _) in enumerate(columns)
    ]

    def line(values: Sequence[str]) -> str:
        first = values[0].ljust(widths[0])
        rest = [v.rjust(w) for v, w in zip(values[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    out = [line([t for t, _, _ in columns]), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


def write_json(path: str | Path, run: Mapping[str, Any], results: Sequence[MethodResult]) -> Path:
    """Write the run settings, the summary rows and every per-request record as JSON.

    Layout: ``{"run": {...}, "summary": [rows], "methods": {name: {"cache": {...} | null,
    "index": {...}, "records": [{request_index, rid, prompt_tokens, cached_tokens, ttft_s}]}}}``;
    records are in send order. Parent directories are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "run": dict(run),
        "summary": summarize(results),
        "methods": {
            r.method: {
                "plan_seconds": r.plan_seconds,
                "cache": asdict(r.cache) if r.cache is not None else None,
                "index": r.index,
                "records": [asdict(x) for x in r.records],
            }
            for r in results
        },
    }
    path.write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def plot_results(path: str | Path, results: Sequence[MethodResult], title: str) -> Path:
    """Save a PNG: hit ratio per method (bars) and cumulative cached tokens (lines).

    The x axis of the lines is the number of requests sent, in each method's send order
    (arrival order for the baseline and the upper bound, the schedule for offline
    ContextPilot). Parent directories are created. Uses matplotlib's Agg backend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r.method for r in results]
    ratios = [r.hit_ratio for r in results]
    colors = [f"C{i}" for i in range(len(results))]
    drawn = bars.bar(names, ratios, color=colors)
    bars.bar_label(drawn, labels=[f"{x:.3f}" for x in ratios], padding=2)
    bars.set_ylabel("cache hit ratio (cached / prompt tokens)")
    bars.set_ylim(0, min(1.0, max(ratios + [0.01]) * 1.2))
    bars.set_title("hit ratio per method")
    for r, color in zip(results, colors, strict=True):
        cumulative = np.cumsum([x.cached_tokens or 0 for x in r.records])
        lines.plot(np.arange(1, len(cumulative) + 1), cumulative, label=r.method, color=color)
    lines.set_xlabel("requests sent")
    lines.set_ylabel("cumulative cached tokens")
    lines.set_title("cached tokens over the workload")
    lines.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
