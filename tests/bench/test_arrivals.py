"""Arrival processes: the seeded Poisson process and the replay of recorded request times."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from contextpilot_bench.arrivals import (
    arrivals_for,
    poisson_arrivals,
    replay_arrivals,
)
from contextpilot_bench.workloads import Document, Request, Workload, load_workload


def test_poisson_is_seeded_and_reproducible() -> None:
    a = poisson_arrivals(1000, 200.0, seed=7)
    b = poisson_arrivals(1000, 200.0, seed=7)
    c = poisson_arrivals(1000, 200.0, seed=8)
    np.testing.assert_array_equal(a.times_s, b.times_s)
    assert not np.array_equal(a.times_s, c.times_s)
    assert a.order == tuple(range(1000)) and a.process == "poisson" and a.rate_per_s == 200.0
    gaps = np.diff(np.concatenate([[0.0], a.times_s]))
    assert (gaps > 0).all()
    # Exponential gaps of mean 1 / rate: the sample mean is within a few standard errors.
    assert gaps.mean() == pytest.approx(1 / 200, rel=4 / math.sqrt(1000))


@pytest.mark.parametrize("rate", [0.0, -5.0, math.nan, math.inf, True])
def test_poisson_rejects_a_bad_rate(rate: float) -> None:
    with pytest.raises(ValueError, match="--rate must be"):
        poisson_arrivals(10, rate)


def test_replay_sorts_keeps_ties_in_order_and_starts_at_zero() -> None:
    arrivals = replay_arrivals([100.0, 90.0, 100.0, 130.0])
    assert arrivals.order == (1, 0, 2, 3)
    np.testing.assert_array_equal(arrivals.times_s, [0.0, 10.0, 10.0, 40.0])
    assert arrivals.rate_per_s == pytest.approx(3 / 40)


def test_replay_at_another_rate_keeps_the_shape_of_the_gaps() -> None:
    arrivals = replay_arrivals([0.0, 10.0, 30.0, 70.0], rate_per_s=300.0)
    assert arrivals.rate_per_s == pytest.approx(300.0)
    np.testing.assert_allclose(np.diff(arrivals.times_s), np.array([10, 20, 40]) / 7000)
    with pytest.raises(ValueError, match="all arrive at once"):
        replay_arrivals([5.0, 5.0], rate_per_s=10.0)
    with pytest.raises(ValueError, match="finite"):
        replay_arrivals([1.0, math.nan])


def _workload(times: list[float | None]) -> Workload:
    requests = tuple(Request(f"r{i}", f"q{i}", arrived_at=t) for i, t in enumerate(times))
    return Workload("timed", (Document("d", "text"),), requests)


def test_arrivals_for_chooses_the_process_and_says_what_is_missing() -> None:
    timed = _workload([3.0, 1.0, 2.0])
    assert arrivals_for("replay", timed, None).order == (1, 2, 0)
    assert arrivals_for("poisson", timed, 10.0, seed=1).order == (0, 1, 2)
    with pytest.raises(ValueError, match="needs --rate"):
        arrivals_for("poisson", timed, None)
    with pytest.raises(ValueError, match="records none for 1 of its 3 requests"):
        arrivals_for("replay", _workload([1.0, None, 2.0]), None)
    with pytest.raises(ValueError, match="arrival must be one of"):
        arrivals_for("bursty", timed, 1.0)


def test_real_workloads_with_and_without_request_times(data_dir: Path) -> None:
    mtrag = load_workload("mtrag", data_dir)
    assert all(r.arrived_at is not None for r in mtrag.requests)
    replay = arrivals_for("replay", mtrag, None)
    assert sorted(replay.order) == list(range(len(mtrag.requests)))
    assert (np.diff(replay.times_s) >= 0).all()
    for name in ("multihop-rag", "locomo"):
        workload = load_workload(name, data_dir)
        with pytest.raises(ValueError, match=f"{name} records none"):
            arrivals_for("replay", workload, None)
