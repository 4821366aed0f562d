"""A benchmark run on a slice of each real workload: ContextPilot must beat the baseline."""

from __future__ import annotations

from pathlib import Path

import pytest
from contextpilot_bench.engine import EmbeddedEngine
from contextpilot_bench.methods import (
    METHODS,
    prepare_workload,
    resolve_cache_tokens,
    run_methods,
)
from contextpilot_bench.report import summarize
from contextpilot_bench.workloads import load_workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter

SLICE = {"multihop-rag": 250, "locomo": 400, "mtrag": 400}


@pytest.mark.parametrize("mode", ["offline", "online"])
@pytest.mark.parametrize("cache", [0.05, None])
@pytest.mark.parametrize("workload", list(SLICE))
def test_contextpilot_beats_baseline(
    data_dir: Path, workload: str, mode: str, cache: float | None
) -> None:
    counter = ApproxTokenCounter()
    prepared = prepare_workload(
        load_workload(workload, data_dir).head(SLICE[workload]), 10, counter=counter
    )
    capacity = resolve_cache_tokens(cache, prepared.unique_block_tokens)
    results = run_methods(
        METHODS,
        prepared,
        mode=mode,
        engine_factory=lambda: EmbeddedEngine(capacity, counter=counter),
    )
    rows = {row["method"]: row for row in summarize(results)}
    base, pilot, upper = rows["baseline"], rows["contextpilot"], rows["upper-bound"]
    assert base["requests"] == pilot["requests"] == upper["requests"] == SLICE[workload]
    assert pilot["hit_ratio"] > base["hit_ratio"] * 1.2, (pilot, base)
    # The bound is an upper bound for both real orders.
    assert pilot["cached_tokens"] <= upper["cached_tokens"]
    assert base["cached_tokens"] <= upper["cached_tokens"]
    if capacity is not None:
        for r in results[:2]:
            assert r.cache is not None and r.cache.peak_used_tokens <= capacity
