"""Report figures and table formatting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextpilot_integrations.bench.methods import MethodResult, RequestRecord
from contextpilot_integrations.bench.report import format_table, plot_results, summarize, write_json


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
