"""ContextPilot behind a planning window, replayed in virtual time.

``contextpilot-bench --mode online --arrival poisson --rate R --window-ms W`` gives every
request an arrival time (:mod:`~contextpilot_bench.arrivals`), groups the requests
into windows with the core's closing rule (:meth:`WindowPolicy.group
<contextpilot_integrations.core.window.window_policy.WindowPolicy.group>`: the same rule
:class:`~contextpilot_integrations.core.window.planning_window.PlanningWindow` applies live),
plans each window against the one shared index, and sends its requests to the engine in the
batch's schedule order, the windows in closing order. Nothing sleeps: the time a request waits
for its window is the rule's virtual time, the time planning takes is measured.

A window of several requests is planned with :meth:`ContextPilot.plan_batch`; a window of one
with :meth:`ContextPilot.plan`, as the planner alone plans it (a batch of one is ordered by the
offline build, not by the online alignment, and differs from it), so ``window_ms=0`` gives
exactly the ``--mode online`` figures.

Added latency of a request (what the window costs it before its prompt can go to the engine):
``(close time of its window - its arrival time) + the measured wall time of its window's
plan_batch`` (or ``plan``), in milliseconds. Evictions the engine reports are passed to the
index after each request is sent, as online.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from contextpilot_bench.arrivals import Arrivals
from contextpilot_bench.engine import EmbeddedEngine, Engine
from contextpilot_bench.methods import (
    MethodResult,
    PreparedWorkload,
    RequestRecord,
    new_pilot,
    send,
)
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import Plan
from contextpilot_integrations.core.request import PlanRequest
from contextpilot_integrations.core.window.window_policy import WindowPolicy

__all__ = ["WindowResult", "run_window", "window_method"]


def window_method(window_ms: float) -> str:
    """The method name of one window length in the report (``"window 10 ms"``)."""
    return f"window {window_ms:g} ms"


@dataclass
class WindowResult:
    """ContextPilot behind one window length.

    Attributes:
        window_ms: the window length (milliseconds).
        policy: the closing rule the requests were grouped by.
        arrivals: the arrival process (its mean rate, its times).
        result: the requests' records, in send order (method :func:`window_method`);
            ``plan_seconds`` is all planning and eviction time, as online.
        window_sizes: requests per window, in closing order.
        added_latency_ms: per request (arrival order), float64 of shape ``(n,)``: the wait
            for its window to close plus its window's planning time (module docstring).
        window_plan_ms: wall time of each window's planning call, in closing order.
    """

    window_ms: float
    policy: WindowPolicy
    arrivals: Arrivals
    result: MethodResult
    window_sizes: list[int]
    added_latency_ms: np.ndarray
    window_plan_ms: list[float]

    @property
    def requests_per_window(self) -> float:
        """Mean requests per window."""
        return len(self.result.records) / len(self.window_sizes) if self.window_sizes else 0.0

    def latency_percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the added latency, milliseconds."""
        return float(np.percentile(self.added_latency_ms, q))


def run_window(
    prepared: PreparedWorkload,
    arrivals: Arrivals,
    policy: WindowPolicy,
    *,
    engine_factory: Callable[[], Engine],
    pilot_factory: Callable[[Engine], ContextPilot] | None = None,
    progress: bool = False,
) -> WindowResult:
    """Replay ``prepared`` (requests in arrival order) through windows of ``policy``.

    Args:
        prepared: the retrieved workload, its requests in arrival order (the order of
            ``arrivals``: :meth:`PreparedWorkload.reordered` by ``arrivals.order``).
        arrivals: when each request arrives (``times_s[i]`` for request ``i``).
        policy: the window length, batch size and adaptive closing.
        engine_factory: a fresh (empty-cache) engine.
        pilot_factory: ``engine -> ContextPilot``, closed after the run (default
            :func:`~contextpilot_bench.methods.new_pilot`).
        progress: a tqdm progress bar on stderr.

    Raises:
        ValueError: ``arrivals`` does not have one time per request.
    """
    requests = prepared.workload.requests
    times = arrivals.times_s
    if len(times) != len(requests):
        raise ValueError(f"{len(times)} arrival times for {len(requests)} requests")
    batch = [
        PlanRequest(r.query, prepared.block_texts(i), f"contextpilot-{r.id}")
        for i, r in enumerate(requests)
    ]
    windows = policy.group(list(zip(times.tolist(), batch, strict=True)))
    engine = engine_factory()
    records: list[RequestRecord] = []
    latency = np.zeros(len(batch), dtype=np.float64)
    window_plan_ms: list[float] = []
    plan_seconds = 0.0
    make_pilot = pilot_factory or (lambda e: new_pilot(prepared, e))
    name = window_method(policy.window_s * 1000)
    with (
        make_pilot(engine) as pilot,
        tqdm(total=len(batch), desc=name, unit="req", disable=not progress, leave=False) as bar,
    ):
        engine.sync(pilot)
        for close_s, members in windows:
            start = time.perf_counter()
            plans, schedule = _plan_window(pilot, [batch[i] for i in members])
            planning = time.perf_counter() - start
            for position in schedule:
                index, plan = members[position], plans[position]
                served = send(engine, plan.rid, plan.segments, pilot)
                records.append(
                    RequestRecord(
                        index, plan.rid, served.prompt_tokens, served.cached_tokens, served.ttft_s
                    )
                )
                evicting = time.perf_counter()
                for rid in engine.take_evicted_rids():
                    pilot.evict(rid)
                plan_seconds += time.perf_counter() - evicting
                bar.update()
            plan_seconds += planning
            window_plan_ms.append(1000 * planning)
            latency[members] = 1000 * (close_s - times[members] + planning)
        engine.sync(pilot)
        result = MethodResult(name, records, plan_seconds=plan_seconds, index=pilot.stats())
    if isinstance(engine, EmbeddedEngine):
        result.cache = engine.model.stats()
    return WindowResult(
        window_ms=policy.window_s * 1000,
        policy=policy,
        arrivals=arrivals,
        result=result,
        window_sizes=[len(members) for _, members in windows],
        added_latency_ms=latency,
        window_plan_ms=window_plan_ms,
    )


def _plan_window(
    pilot: ContextPilot, requests: list[PlanRequest]
) -> tuple[tuple[Plan, ...], tuple[int, ...]]:
    """Plans of one window (input order) and the order to send them in."""
    if len(requests) == 1:
        (request,) = requests
        return (pilot.plan(request.query, request.blocks, rid=request.rid),), (0,)
    planned = pilot.plan_batch(requests)
    return tuple(planned.plans), tuple(planned.schedule)
