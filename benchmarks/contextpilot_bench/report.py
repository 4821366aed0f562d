"""Benchmark reports: a table for the terminal, JSON for machines, a PNG plot for people.

Figures per method (all token counts are prompt tokens):

* ``hit_ratio`` = cached tokens / prompt tokens (the paper's cache hit ratio);
* ``prefill_tokens`` = prompt tokens - cached tokens (what the engine computes);
* ``vs_upper_bound`` = hit ratio / the upper bound's hit ratio (same run);
* ``vs_baseline`` = hit ratio / the baseline's hit ratio (same run; ``None`` when the baseline
  hit nothing);
* ``vs_clairvoyant_arrival`` = hit ratio / the ``clairvoyant-arrival`` method's hit ratio (the
  offline plan sent in arrival order, :mod:`~contextpilot_bench.methods`), only in runs with
  that method; printed as its own line (:func:`clairvoyant_check`), not as a column;
* with a real engine: TTFT mean, median and p99 in seconds;
* with a real model's answers (:mod:`~contextpilot_bench.real_model`): exact
  match, token F1, gold contained, and gold contained's paired difference to the baseline with
  its 95% interval.

Every run also says whether a method's prefill tokens are above the baseline's
(:func:`prefill_check`): a user must never pay more than without the library.

Planning windows (:mod:`~contextpilot_bench.window_runner`), one row per window
length (:func:`summarize_windows`): requests per window, hit ratio and its share of the offline
figure, prefill tokens against the baseline's, and the added latency per request (p50, p99, in
ms); the target is a hit ratio >= :data:`WINDOW_TARGET_VS_OFFLINE` of the offline figure
with an added p50 latency no more than the window (for a 5% cache and about 16 requests
arriving per window). :func:`plot_window_tradeoff` draws both against the window length.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from contextpilot_bench.methods import CLAIRVOYANT_ARRIVAL, MethodResult
from contextpilot_bench.online_bounds import is_online_bound
from contextpilot_bench.window_runner import WindowResult

__all__ = [
    "ANSWER_COLUMNS",
    "WINDOW_COLUMNS",
    "WINDOW_TARGET_CACHE",
    "WINDOW_TARGET_VS_OFFLINE",
    "clairvoyant_check",
    "format_table",
    "plot_results",
    "plot_window_tradeoff",
    "prefill_check",
    "summarize",
    "summarize_windows",
    "write_json",
]

BASELINE = "baseline"
UPPER_BOUND = "upper-bound"
REFERENCES = (UPPER_BOUND, CLAIRVOYANT_ARRIVAL)
"""Methods that are references, not what a user runs: left out of :func:`prefill_check`."""
WINDOW_TARGET_VS_OFFLINE = 0.6
"""The target: a planning window's hit ratio at least this share of the offline figure (with the
cache of :data:`WINDOW_TARGET_CACHE`)."""
WINDOW_TARGET_CACHE = 0.05
"""The cache the window target is set for: this fraction of the unique block tokens."""


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def summarize(results: Sequence[MethodResult]) -> list[dict[str, Any]]:
    """One row of figures per method, in the order of ``results``.

    Returns:
        Dicts with ``method, requests, prompt_tokens, cached_tokens, prefill_tokens,
        hit_ratio, vs_upper_bound, vs_baseline, plan_ms_per_request``, in a run with the
        ``clairvoyant-arrival`` method ``vs_clairvoyant_arrival`` and, when the engine reported
        TTFT, ``ttft_mean_s, ttft_p50_s, ttft_p99_s``. A ratio is ``None`` when its reference
        method is not in the run or hit nothing.
    """
    by_name = {r.method: r for r in results}
    upper = by_name[UPPER_BOUND].hit_ratio if UPPER_BOUND in by_name else None
    base = by_name[BASELINE].hit_ratio if BASELINE in by_name else None
    clairvoyant = by_name.get(CLAIRVOYANT_ARRIVAL)
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
        if clairvoyant is not None:
            row["vs_clairvoyant_arrival"] = _ratio(r.hit_ratio, clairvoyant.hit_ratio)
        ttfts = np.array([x.ttft_s for x in r.records if x.ttft_s is not None], dtype=float)
        if ttfts.size:
            row["ttft_mean_s"] = float(ttfts.mean())
            row["ttft_p50_s"] = float(np.percentile(ttfts, 50))
            row["ttft_p99_s"] = float(np.percentile(ttfts, 99))
        rows.append(row)
    return rows


ANSWER_COLUMNS = (
    ("EM", "exact_match", "ratio"),
    ("F1", "f1", "ratio"),
    ("gold contained", "gold_contained", "ratio"),
    ("gold vs baseline, points [95%]", "gold_contained_vs_baseline", "str"),
)
"""Answer columns, shown when the rows carry answer scores
(:func:`~contextpilot_bench.real_model.add_answer_columns`)."""

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


def prefill_check(rows: Sequence[Mapping[str, Any]], *, group: str | None = None) -> list[str]:
    """Whether each method's prefill tokens are above the baseline's, as printed lines.

    Args:
        rows: figures with ``method`` and ``prefill_tokens`` (:func:`summarize`); the baseline
            is the row named ``baseline``, the references (:data:`REFERENCES`: the upper
            bound, no real schedule, and the clairvoyant order, no real planner) are left out.
        group: a row key to compare within (``sessions``: each method against the baseline
            with the same value), one line per value; ``None``: one line.

    Returns:
        Lines such as ``"prefill tokens vs baseline: none above (contextpilot -1.1%)"`` or
        ``"prefill tokens vs baseline: ABOVE for contextpilot (+2.0%); ..."``.
    """
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row.get(group) if group else None, []).append(row)
    lines = []
    for value, members in groups.items():
        label = "prefill tokens vs baseline" + (f" ({group} {value})" if group else "")
        base = next((r["prefill_tokens"] for r in members if r["method"] == BASELINE), None)
        others = [
            r
            for r in members
            if r["method"] not in (BASELINE, *REFERENCES) and not is_online_bound(r["method"])
        ]
        if base is None or not others:
            lines.append(f"{label}: n/a (needs the baseline and a method beside it)")
            continue
        changes = [(r["method"], r["prefill_tokens"] / base - 1 if base else 0.0) for r in others]
        above = [f"{m} ({c:+.1%})" for m, c in changes if c > 0]
        rest = ", ".join(f"{m} {c:+.1%}" for m, c in changes if c <= 0)
        if above:
            tail = f"; not above: {rest}" if rest else ""
            lines.append(f"{label}: ABOVE for {', '.join(above)}{tail}")
        else:
            lines.append(f"{label}: none above ({rest})")
    return lines


def clairvoyant_check(rows: Sequence[Mapping[str, Any]], mode: str) -> list[str]:
    """Each method's share of the ``clairvoyant-arrival`` hit ratio, as printed lines.

    Args:
        rows: :func:`summarize` rows.
        mode: the run's ``--mode``, named in the line (in ``online`` the share is what an
            online planner reaches of what knowing the future gives in the same order).

    Returns:
        ``[]`` without a ``clairvoyant-arrival`` row; else one line such as
        ``"hit ratio vs clairvoyant-arrival (0.5100, the offline plan sent in arrival order;
        mode online): contextpilot 0.7674"`` and, where the baseline is in the run, the
        clairvoyant order's prefill tokens against the baseline's.
    """
    by_name = {r["method"]: r for r in rows}
    clairvoyant = by_name.get(CLAIRVOYANT_ARRIVAL)
    if clairvoyant is None:
        return []
    shares = [
        f"{r['method']} {_fmt(r.get('vs_clairvoyant_arrival'), 'ratio')}"
        for r in rows
        if r["method"] not in (BASELINE, *REFERENCES)
    ]
    line = (
        f"hit ratio vs {CLAIRVOYANT_ARRIVAL} ({clairvoyant['hit_ratio']:.4f}, the offline plan "
        f"sent in arrival order; mode {mode}): {', '.join(shares) or 'n/a'}"
    )
    base = by_name.get(BASELINE)
    if base is not None and base["prefill_tokens"]:
        change = clairvoyant["prefill_tokens"] / base["prefill_tokens"] - 1
        line += f"; its prefill tokens vs baseline {change:+.1%}"
    return [line]


def summarize_windows(
    windows: Sequence[WindowResult],
    *,
    baseline_prefill: int | None,
    offline_hit_ratio: float | None,
    target_applies: bool = True,
) -> list[dict[str, Any]]:
    """One row of figures per window length, in the order of ``windows``.

    Args:
        windows: the window runs.
        baseline_prefill: the baseline's prefill tokens (``None``: not run).
        offline_hit_ratio: offline ContextPilot's hit ratio on the same workload and cache
            (``None``: not run).
        target_applies: whether the run is one the target is set for (a 5% cache); else
            ``target`` is ``None``.

    Returns:
        Dicts with ``method, window_ms, rate_per_s, windows, requests_per_window,
        largest_window, hit_ratio, vs_offline, prefill_tokens, prefill_vs_baseline,
        added_p50_ms, added_p99_ms, plan_ms_per_window, target`` (``"met"``, ``"missed"``, or
        ``None`` for a zero window, without the offline figure or where the target does not
        apply). Latencies in milliseconds.
    """
    rows = []
    for w in windows:
        r = w.result
        vs_offline = _ratio(r.hit_ratio, offline_hit_ratio)
        p50 = w.latency_percentile(50)
        target = None
        if target_applies and vs_offline is not None and w.window_ms > 0:
            met = vs_offline >= WINDOW_TARGET_VS_OFFLINE and p50 <= w.window_ms
            target = "met" if met else "missed"
        rows.append(
            {
                "method": r.method,
                "window_ms": w.window_ms,
                "rate_per_s": w.arrivals.rate_per_s,
                "windows": len(w.window_sizes),
                "requests_per_window": w.requests_per_window,
                "largest_window": max(w.window_sizes, default=0),
                "hit_ratio": r.hit_ratio,
                "vs_offline": vs_offline,
                "prefill_tokens": r.prefill_tokens,
                "prefill_vs_baseline": _ratio(r.prefill_tokens, baseline_prefill),
                "added_p50_ms": p50,
                "added_p99_ms": w.latency_percentile(99),
                "plan_ms_per_window": float(np.mean(w.window_plan_ms)) if w.window_plan_ms else 0.0,
                "target": target,
            }
        )
    return rows


WINDOW_COLUMNS = (
    ("window ms", "window_ms", "g"),
    ("rate /s", "rate_per_s", "g"),
    ("windows", "windows", "int"),
    ("req/window", "requests_per_window", "f1"),
    ("hit ratio", "hit_ratio", "ratio"),
    ("vs offline", "vs_offline", "ratio"),
    ("prefill tokens", "prefill_tokens", "int"),
    ("prefill vs baseline", "prefill_vs_baseline", "ratio"),
    ("added p50 ms", "added_p50_ms", "ms"),
    ("added p99 ms", "added_p99_ms", "ms"),
    ("target", "target", "str"),
)
"""Columns of :func:`format_table` for the rows of :func:`summarize_windows`."""


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if kind == "int":
        return f"{value:,}"
    if kind == "g":
        return f"{value:,.4g}"
    if kind == "f1":
        return f"{value:.1f}"
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
        columns: ``(title, row key, kind)`` per column, kind one of ``str``, ``int``, ``g``
            (a number, 4 significant digits), ``f1``, ``ratio``, ``x``, ``s``, ``ms``; default
            the columns of :func:`summarize`.
    """
    columns = list(columns) if columns is not None else list(_COLUMNS)
    if any("ttft_mean_s" in r for r in rows):
        columns += [("TTFT mean s", "ttft_mean_s", "s"), ("TTFT p50 s", "ttft_p50_s", "s")]
    if any("gold_contained" in r for r in rows):
        columns += list(ANSWER_COLUMNS)
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


def write_json(
    path: str | Path,
    run: Mapping[str, Any],
    results: Sequence[MethodResult],
    windows: Sequence[WindowResult] = (),
    window_rows: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Write the run settings, the summary rows and every per-request record as JSON.

    Layout: ``{"run": {...}, "summary": [rows], "methods": {name: {"cache": {...} | null,
    "index": {...}, "records": [{request_index, rid, prompt_tokens, cached_tokens, ttft_s}]}}}``;
    records are in send order. With planning windows also ``"windows": [{**row,
    "window_sizes": [...], "window_plan_ms": [...], "added_latency_ms": [...]}]`` (a
    :func:`summarize_windows` row each, sizes and planning times in closing order, latencies in
    arrival order); their records are under ``methods`` by their method name. Parent
    directories are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "run": dict(run),
        "summary": summarize([*results, *(w.result for w in windows)]),
        "methods": {
            r.method: {
                "plan_seconds": r.plan_seconds,
                "cache": asdict(r.cache) if r.cache is not None else None,
                "index": r.index,
                "records": [asdict(x) for x in r.records],
            }
            for r in [*results, *(w.result for w in windows)]
        },
    }
    if windows:
        document["windows"] = [
            {
                **row,
                "window_sizes": w.window_sizes,
                "window_plan_ms": w.window_plan_ms,
                "added_latency_ms": w.added_latency_ms.tolist(),
            }
            for row, w in zip(window_rows, windows, strict=True)
        ]
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


def plot_window_tradeoff(
    path: str | Path,
    rows: Sequence[Mapping[str, Any]],
    title: str,
    references: Mapping[str, float],
) -> Path:
    """Save a PNG of the planning window's trade-off against the window length.

    Left: hit ratio per window length (each point labelled with its mean requests per
    window), with ``references`` (name -> hit ratio: offline,
    online without a window, baseline) as horizontal lines and the target share of the
    offline figure. Right: the added latency p50 and p99 per request (ms), with the line
    latency = window (the target bounds p50 by it).

    Args:
        rows: :func:`summarize_windows` rows.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda r: r["window_ms"])
    x = [r["window_ms"] for r in ordered]
    fig, (hits, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    hits.plot(x, [r["hit_ratio"] for r in ordered], "o-", color="C1", label="planning window")
    for r in ordered:  # the rate may differ per window: say how many requests each one held
        hits.annotate(
            f"{r['requests_per_window']:.1f}/window",
            (r["window_ms"], r["hit_ratio"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize="x-small",
        )
    for i, (name, value) in enumerate(references.items()):
        hits.axhline(value, linestyle="--", color=f"C{i + 2}", label=f"{name} ({value:.3f})")
    offline = references.get("offline")
    if offline is not None:
        hits.axhline(
            WINDOW_TARGET_VS_OFFLINE * offline,
            linestyle=":",
            color="grey",
            label=f"target: {WINDOW_TARGET_VS_OFFLINE:g} x offline",
        )
    hits.set_xlabel("window (ms)")
    hits.set_ylabel("cache hit ratio (cached / prompt tokens)")
    hits.set_ylim(bottom=0)
    hits.set_title("hit ratio")
    hits.legend(fontsize="small")
    latency.plot(x, [r["added_p50_ms"] for r in ordered], "o-", color="C0", label="p50")
    latency.plot(x, [r["added_p99_ms"] for r in ordered], "s-", color="C3", label="p99")
    latency.plot(x, x, ":", color="grey", label="latency = window")
    latency.set_xlabel("window (ms)")
    latency.set_ylabel("added latency per request (ms)")
    latency.set_title("wait for the window + its planning time")
    latency.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
