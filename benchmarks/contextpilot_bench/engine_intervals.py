"""The engine's figures of a scored run with 95% bootstrap intervals: per method the hit ratio
and median TTFT, and the ratio of the baseline's median TTFT to the method's.

The requests are resampled with replacement (2,000 resamples, seeded) by question, the same
resample for every method (paired), and each statistic recomputed on it
(:func:`~contextpilot_bench.answer_scoring.bootstrap_statistic`). A request's
cached tokens depend on what was sent before it; a resample keeps each request's figures as
measured, so the interval is the spread over these questions, not over reruns of the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from contextpilot_bench.answer_scoring import Interval, bootstrap_statistic
from contextpilot_bench.methods import MethodResult

__all__ = ["engine_interval_lines", "engine_intervals"]


def engine_intervals(
    results: Sequence[MethodResult], *, resamples: int = 2000, seed: int = 0
) -> dict[str, dict[str, Interval]]:
    """Per method the engine's hit ratio (cached / prompt tokens) and median TTFT (s), and
    beside the baseline the ratio of medians ``baseline TTFT / method TTFT`` (times lower),
    each with a 95% bootstrap interval over the requests every method sent (paired: one
    resample of questions for all methods;
    :func:`~contextpilot_bench.answer_scoring.bootstrap_statistic`).

    The interval is the spread over these questions with the cache's figures as measured: a
    request's cached tokens depend on what was sent before it, which a resample keeps.

    Returns:
        method -> ``{"hit_ratio", "ttft_p50_s"[, "ttft_p50_vs_baseline"]}``; methods without
        TTFT for every request, or no request in common, are left out.
    """
    by_method: dict[str, dict[int, tuple[int, int, float]]] = {}
    for r in results:
        rows = {
            x.request_index: (x.prompt_tokens, x.cached_tokens or 0, x.ttft_s)
            for x in r.records
            if x.ttft_s is not None
        }
        if rows and len(rows) == len(r.records):
            by_method[r.method] = rows
    if not by_method:
        return {}
    common = sorted(set.intersection(*(set(rows) for rows in by_method.values())))
    if not common:
        return {}
    arrays = {m: np.array([rows[i] for i in common], dtype=float) for m, rows in by_method.items()}

    def hit(a: np.ndarray) -> Callable[[np.ndarray], float]:
        return lambda picks: float(a[picks, 1].sum() / max(a[picks, 0].sum(), 1.0))

    def median(a: np.ndarray) -> Callable[[np.ndarray], float]:
        return lambda picks: float(np.median(a[picks, 2]))

    options = {"resamples": resamples, "seed": seed}
    out: dict[str, dict[str, Interval]] = {}
    base = arrays.get("baseline")
    for method, a in arrays.items():
        found = {
            "hit_ratio": bootstrap_statistic(hit(a), len(common), **options),
            "ttft_p50_s": bootstrap_statistic(median(a), len(common), **options),
        }
        if base is not None and method != "baseline":

            def lower(picks: np.ndarray, a: np.ndarray = a) -> float:
                return float(np.median(base[picks, 2]) / np.median(a[picks, 2]))

            found["ttft_p50_vs_baseline"] = bootstrap_statistic(lower, len(common), **options)
        out[method] = found
    return out


def engine_interval_lines(results: Sequence[MethodResult], run: dict[str, Any]) -> list[str]:
    """The report's lines of :func:`engine_intervals` (also put in
    ``run["engine_intervals"]``); ``[]`` when no method has TTFT figures."""
    intervals = engine_intervals(results)
    if not intervals:
        return []
    run["engine_intervals"] = {
        m: {name: asdict(i) for name, i in found.items()} for m, found in intervals.items()
    }
    questions = min(len(r.records) for r in results if r.method in intervals)
    lines = [
        f"engine figures with 95% bootstrap intervals over the {questions:,} questions (paired "
        "across methods; the spread over questions, not over reruns):"
    ]
    for method, found in intervals.items():
        h, t = found["hit_ratio"], found["ttft_p50_s"]
        text = (
            f"  {method}: hit ratio {h.mean:.4f} [{h.low:.4f}, {h.high:.4f}]; median TTFT "
            f"{t.mean:.3f} s [{t.low:.3f}, {t.high:.3f}]"
        )
        lower = found.get("ttft_p50_vs_baseline")
        if lower is not None:
            text += f"; baseline / {method}: {lower.mean:.2f}x [{lower.low:.2f}, {lower.high:.2f}]"
        lines.append(text)
    return lines
