"""The engine's figures of a scored run with paired bootstrap intervals."""

from __future__ import annotations

import numpy as np
import pytest
from contextpilot_bench.engine_intervals import (
    engine_interval_lines,
    engine_intervals,
)
from contextpilot_bench.methods import MethodResult, RequestRecord


def _result(method: str, rows: list[tuple[int, int, int | None, float | None]]) -> MethodResult:
    records = [RequestRecord(i, f"{method}-{i}", p, c, t) for i, p, c, t in rows]
    return MethodResult(method=method, records=records)


def test_ratio_of_medians_is_paired_by_question() -> None:
    ttft = np.random.default_rng(1).uniform(0.5, 1.5, size=30)
    baseline = _result("baseline", [(i, 100, 0, float(t)) for i, t in enumerate(ttft)])
    # half the TTFT of the same question, sent in another order
    faster = _result("cp", [(i, 100, 50, float(ttft[i] / 2)) for i in reversed(range(30))])
    found = engine_intervals([baseline, faster])
    assert set(found) == {"baseline", "cp"}
    assert "ttft_p50_vs_baseline" not in found["baseline"]
    lower = found["cp"]["ttft_p50_vs_baseline"]
    # paired: every resample halves every question, so the interval has no width
    assert (lower.mean, lower.low, lower.high) == pytest.approx((2.0, 2.0, 2.0))
    hit = found["cp"]["hit_ratio"]
    assert (hit.mean, hit.low, hit.high) == pytest.approx((0.5, 0.5, 0.5))
    median = found["baseline"]["ttft_p50_s"]
    assert median.mean == pytest.approx(float(np.median(ttft)))
    assert median.low < median.mean < median.high


def test_hit_ratio_is_cached_over_prompt_tokens_of_the_resample() -> None:
    rows = [(0, 100, 100, 0.1), (1, 300, 0, 0.3), (2, 100, 0, 0.2), (3, 500, 250, 0.4)]
    found = engine_intervals([_result("baseline", rows)])
    hit = found["baseline"]["hit_ratio"]
    assert hit.mean == pytest.approx(350 / 1000)
    assert 0.0 <= hit.low < hit.mean < hit.high <= 1.0


def test_methods_without_ttft_are_left_out_and_lines_say_so() -> None:
    baseline = _result("baseline", [(0, 10, 0, 0.2), (1, 10, 0, 0.4)])
    embedded = _result("contextpilot", [(0, 10, 5, None), (1, 10, 5, None)])
    run: dict = {}
    lines = engine_interval_lines([baseline, embedded], run)
    assert set(run["engine_intervals"]) == {"baseline"}
    assert len(lines) == 2 and lines[1].startswith("  baseline: hit ratio 0.0000")
    assert engine_interval_lines([embedded], {}) == []
