"""Arrival processes: when each request of a workload reaches the planner, in virtual time.

The planning-window benchmark (``contextpilot-bench --mode online --arrival ...``) replays these
times through the core's closing rule (:meth:`WindowPolicy.group
<contextpilot_integrations.core.window.window_policy.WindowPolicy.group>`) without sleeping.

``poisson``
    Requests arrive in the workload's order, the gaps between them drawn independently from an
    exponential distribution of mean ``1 / rate`` seconds (a Poisson process of ``rate``
    requests per second), seeded: the same seed gives the same times.
``replay``
    Requests arrive at the times the data records (``Request.arrived_at``), sorted (ties keep
    the workload's order); the first arrives at 0. With a ``rate``, every gap is scaled by one
    factor so that the mean rate over the replay is ``rate`` (the shape of the traffic, its
    bursts and lulls, is kept). Only workloads that record request times can be replayed:
    MTRAG records when each user turn was written; MultiHop-RAG's dates are those of the
    evidence articles and LoCoMo's those of the dialog sessions, not of the questions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from contextpilot_bench.workloads import Workload

__all__ = ["ARRIVALS", "Arrivals", "arrivals_for", "poisson_arrivals", "replay_arrivals"]

ARRIVALS = ("poisson", "replay")


@dataclass(frozen=True)
class Arrivals:
    """When the requests arrive.

    Attributes:
        process: ``"poisson"`` or ``"replay"``.
        order: workload request indices in arrival order (a permutation of ``range(n)``).
        times_s: arrival time of ``order[i]`` in seconds from the first arrival's start, float64
            of shape ``(n,)``, non-decreasing.
        rate_per_s: requests per second: the Poisson process's rate, or the replay's mean
            ``(n - 1) / span`` (``inf`` when every request arrives at once, ``nan`` for one).
    """

    process: str
    order: tuple[int, ...]
    times_s: np.ndarray
    rate_per_s: float


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> Arrivals:
    """``n`` requests in workload order, exponential gaps of mean ``1 / rate_per_s`` seconds.

    The first request arrives after one gap, like every other (a process already running).

    Raises:
        ValueError: ``n`` < 1, or ``rate_per_s`` not a finite number > 0.
    """
    _check_rate(rate_per_s)
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=n)
    return Arrivals("poisson", tuple(range(n)), np.cumsum(gaps), float(rate_per_s))


def replay_arrivals(recorded_s: Sequence[float], rate_per_s: float | None = None) -> Arrivals:
    """Replay recorded request times (seconds, any origin), optionally at another mean rate.

    Raises:
        ValueError: no times, a time that is not finite, or ``rate_per_s`` not a finite number
            > 0; a ``rate_per_s`` when every request was recorded at the same time.
    """
    times = np.asarray(recorded_s, dtype=np.float64)
    if times.size == 0:
        raise ValueError("need at least one recorded time")
    if not np.isfinite(times).all():
        raise ValueError("recorded request times must be finite")
    order = np.argsort(times, kind="stable")
    times = times[order] - times[order[0]]
    span = float(times[-1])
    if rate_per_s is not None:
        _check_rate(rate_per_s)
        if span == 0:
            raise ValueError("--rate cannot rescale a replay whose requests all arrive at once")
        times *= (times.size - 1) / (span * rate_per_s)
        span = float(times[-1])
    return Arrivals("replay", tuple(int(i) for i in order), times, _mean_rate(times.size, span))


def arrivals_for(
    process: str, workload: Workload, rate_per_s: float | None, seed: int = 0
) -> Arrivals:
    """The arrival process ``process`` for ``workload``'s requests.

    Raises:
        ValueError: an unknown process; ``poisson`` without a rate; ``replay`` on a workload
            that does not record when each request was made (the message says which do).
    """
    if process == "poisson":
        if rate_per_s is None:
            raise ValueError("--arrival poisson needs --rate (requests per second)")
        return poisson_arrivals(len(workload.requests), rate_per_s, seed)
    if process == "replay":
        recorded = [r.arrived_at for r in workload.requests]
        missing = sum(t is None for t in recorded)
        if missing:
            raise ValueError(
                f"--arrival replay needs the time each request was made, and {workload.name} "
                f"records none for {missing:,} of its {len(recorded):,} requests (MultiHop-RAG's "
                "dates are the evidence articles', LoCoMo's the dialog sessions', not the "
                "questions'); mtrag records them (when each user turn was written). Use "
                "--arrival poisson --rate R instead"
            )
        return replay_arrivals([t for t in recorded if t is not None], rate_per_s)
    raise ValueError(f"arrival must be one of {ARRIVALS}, got {process!r}")


def _mean_rate(n: int, span_s: float) -> float:
    if n == 1:
        return math.nan
    return (n - 1) / span_s if span_s > 0 else math.inf


def _check_rate(rate_per_s: float) -> None:
    if isinstance(rate_per_s, bool) or not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ValueError(f"--rate must be a number of requests per second > 0, got {rate_per_s!r}")
