"""Report figures and table formatting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from contextpilot_bench.arrivals import Arrivals
from contextpilot_bench.methods import MethodResult, RequestRecord
from contextpilot_bench.report import (
    WINDOW_COLUMNS,
    clairvoyant_check,
    format_table,
    plot_results,
    plot_window_tradeoff,
    prefill_check,
    summarize,
    summarize_windows,
    write_json,
)
from contextpilot_bench.window_runner import WindowResult, window_method

from contextpilot_integrations.core.window.window_policy import WindowPolicy


def _result(
    method: str, pairs: list[tuple[int, int | None]], ttft: float | None = None
) -> MethodResult:
    return MethodResult(
        method, [RequestRecord(i, f"{method}-{i}", p, c, ttft) for i, (p, c) in enumerate(pairs)]
    )


def test_ratios_and_prefill() -> None:
    results = [
        _result("baseline", [(100, 10), (100, 10)]),
        _result("contextpilot", [(110, 55), (110, 55)]),
        _result("upper-bound", [(100, 80), (100, 80)]),
    ]
    rows = {r["method"]: r for r in summarize(results)}
    assert rows["contextpilot"]["prefill_tokens"] == 110
    assert rows["contextpilot"]["hit_ratio"] == pytest.approx(0.5)
    assert rows["contextpilot"]["vs_baseline"] == pytest.approx(5.0)
    assert rows["contextpilot"]["vs_upper_bound"] == pytest.approx(0.625)
    table = format_table(summarize(results))
    assert table.splitlines()[3].split() == [
        "contextpilot",
        "2",
        "220",
        "110",
        "110",
        "0.5000",
        "0.6250",
        "5.00x",
    ]


def test_missing_references_and_unreported_cache_print_na(tmp_path: Path) -> None:
    results = [
        _result("baseline", [(100, 0)], ttft=0.5),
        _result("contextpilot", [(100, None)], ttft=0.25),
    ]
    rows = summarize(results)
    assert rows[0]["vs_upper_bound"] is None and rows[1]["vs_baseline"] is None
    assert rows[1]["cached_tokens"] == 0 and rows[1]["ttft_p50_s"] == 0.25
    table = format_table(rows)
    assert "n/a" in table and "TTFT mean s" in table
    path = write_json(tmp_path / "a" / "b.json", {"workload": "w"}, results)
    document = json.loads(path.read_text())
    assert document["methods"]["contextpilot"]["records"][0]["cached_tokens"] is None
    png = plot_results(tmp_path / "p.png", results, "title")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_prefill_check_names_every_method_above_the_baseline() -> None:
    rows = [
        {"method": "baseline", "prefill_tokens": 1000},
        {"method": "contextpilot", "prefill_tokens": 1020},
        {"method": "window 10 ms", "prefill_tokens": 800},
        {"method": "upper-bound", "prefill_tokens": 10},
    ]
    (line,) = prefill_check(rows)
    assert line == (
        "prefill tokens vs baseline: ABOVE for contextpilot (+2.0%); not above: window 10 ms -20.0%"
    )
    rows[1]["prefill_tokens"] = 1000
    assert prefill_check(rows) == [
        "prefill tokens vs baseline: none above (contextpilot +0.0%, window 10 ms -20.0%)"
    ]
    assert "n/a" in prefill_check(rows[1:])[0]


def test_the_clairvoyant_share_is_online_over_clairvoyant() -> None:
    results = [
        _result("baseline", [(100, 10), (100, 10)]),
        _result("contextpilot", [(110, 33), (110, 33)]),
        _result("clairvoyant-arrival", [(110, 44), (110, 44)]),
        _result("upper-bound", [(100, 80), (100, 80)]),
    ]
    rows = summarize(results)
    by_name = {r["method"]: r for r in rows}
    online = by_name["contextpilot"]
    assert online["vs_clairvoyant_arrival"] == pytest.approx(0.3 / 0.4)
    assert by_name["clairvoyant-arrival"]["vs_clairvoyant_arrival"] == pytest.approx(1.0)
    # the other figures are those of a run without it
    without = {r["method"]: r for r in summarize([results[0], results[1], results[3]])}
    assert {k: v for k, v in online.items() if k != "vs_clairvoyant_arrival"} == without[
        "contextpilot"
    ]
    assert "vs_clairvoyant_arrival" not in without["contextpilot"]
    assert clairvoyant_check(rows, "online") == [
        "hit ratio vs clairvoyant-arrival (0.4000, the offline plan sent in arrival order; "
        "mode online): contextpilot 0.7500; its prefill tokens vs baseline -26.7%"
    ]
    assert clairvoyant_check(summarize([results[0], results[1]]), "online") == []
    # a reference, not a planner: the prefill line does not judge it
    assert prefill_check(rows) == ["prefill tokens vs baseline: none above (contextpilot -14.4%)"]


def test_prefill_check_compares_within_a_group() -> None:
    rows = [
        {"method": "baseline", "sessions": 1, "prefill_tokens": 100},
        {"method": "alignment", "sessions": 1, "prefill_tokens": 90},
        {"method": "baseline", "sessions": 8, "prefill_tokens": 50},
        {"method": "alignment", "sessions": 8, "prefill_tokens": 60},
    ]
    assert prefill_check(rows, group="sessions") == [
        "prefill tokens vs baseline (sessions 1): none above (alignment -10.0%)",
        "prefill tokens vs baseline (sessions 8): ABOVE for alignment (+20.0%)",
    ]


def _window(window_ms: float, latencies: list[float], sizes: list[int]) -> WindowResult:
    n = len(latencies)
    result = _result(window_method(window_ms), [(100, 60)] * n)
    return WindowResult(
        window_ms=window_ms,
        policy=WindowPolicy(window_ms / 1000),
        arrivals=Arrivals("poisson", tuple(range(n)), np.arange(n, dtype=float), 1600.0),
        result=result,
        window_sizes=sizes,
        added_latency_ms=np.asarray(latencies),
        window_plan_ms=[0.5] * len(sizes),
    )


def test_window_rows_ratios_latency_and_target(tmp_path: Path) -> None:
    windows = [
        _window(0, [0.1, 0.1, 0.1, 0.1], [1, 1, 1, 1]),
        _window(10, [2.0, 4.0, 6.0, 30.0], [2, 2]),
        _window(5, [6.0, 6.0, 6.0, 6.0], [4]),
    ]
    rows = summarize_windows(windows, baseline_prefill=200, offline_hit_ratio=0.7)
    zero, ten, five = rows
    assert zero["target"] is None and zero["requests_per_window"] == 1.0
    assert ten["hit_ratio"] == pytest.approx(0.6) and ten["vs_offline"] == pytest.approx(0.6 / 0.7)
    assert ten["prefill_vs_baseline"] == pytest.approx(160 / 200)
    assert ten["added_p50_ms"] == pytest.approx(5.0) and ten["target"] == "met"
    assert ten["added_p99_ms"] == pytest.approx(float(np.percentile([2, 4, 6, 30], 99)))
    assert five["target"] == "missed"  # p50 6 ms > the 5 ms window
    assert (
        summarize_windows(windows, baseline_prefill=None, offline_hit_ratio=None)[1]["target"]
        is None
    )
    table = format_table(rows, WINDOW_COLUMNS)
    assert table.splitlines()[3].split()[:4] == ["10", "1,600", "2", "2.0"]
    png = plot_window_tradeoff(
        tmp_path / "w.png", rows, "t", {"offline": 0.7, "online, no window": 0.2}
    )
    assert png.read_bytes()[:4] == b"\x89PNG"
    path = write_json(tmp_path / "w.json", {}, [], windows, rows)
    document = json.loads(path.read_text())
    assert document["windows"][1]["added_latency_ms"] == [2.0, 4.0, 6.0, 30.0]
    assert set(document["methods"]) == {"window 0 ms", "window 10 ms", "window 5 ms"}
