"""The planning-window runner: window 0 is the online run, a window planned jointly is sent in
its schedule order (windows in closing order), and the added latency is as defined."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from contextpilot_bench import window_runner
from contextpilot_bench.arrivals import Arrivals, poisson_arrivals
from contextpilot_bench.engine import EmbeddedEngine, Engine, Served
from contextpilot_bench.methods import PreparedWorkload, run_method
from contextpilot_bench.window_runner import run_window, window_method
from contextpilot_bench.workloads import Document, Request, Workload

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.plan import BatchPlan, Plan
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest, Scope
from contextpilot_integrations.core.window.window_policy import WindowPolicy

COUNTER = ApproxTokenCounter()


def _prepared(lists: list[list[int]], doc_len: int = 60) -> PreparedWorkload:
    n_docs = max(d for docs in lists for d in docs) + 1
    corpus = tuple(
        Document(f"d{i}", f"document {i} " + "x" * (doc_len + 7 * i)) for i in range(n_docs)
    )
    requests = tuple(Request(f"r{i}", f"question {i}?") for i in range(len(lists)))
    retrieved = [[corpus[d] for d in docs] for docs in lists]
    return PreparedWorkload(
        Workload("synthetic", corpus, requests), 10, retrieved, PromptLayout(), COUNTER
    )


LISTS = [[i % 7, (i * 3) % 7, 7 + i % 4, (i + 2) % 7] for i in range(60)]


def _arrivals(times: Sequence[float]) -> Arrivals:
    return Arrivals("poisson", tuple(range(len(times))), np.asarray(times, float), 1.0)


class _RecordingEngine(EmbeddedEngine):
    def __init__(self, capacity: int | None) -> None:
        super().__init__(capacity, counter=COUNTER)
        self.sent: list[str] = []

    def serve(self, rid: str, segments: Sequence[str]) -> Served:
        self.sent.append(rid)
        return super().serve(rid, segments)


class _SpyPilot(ContextPilot):
    """Records every window it plans (the batch plan, or the one plan of a window of one)."""

    def __init__(self) -> None:
        super().__init__(token_counter=COUNTER)
        self.windows: list[BatchPlan | Plan] = []

    def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
        batch = super().plan_batch(requests)
        self.windows.append(batch)
        return batch

    def plan(
        self,
        query: str,
        blocks: Sequence[str],
        *,
        rid: str | None = None,
        scope: Scope | None = None,
    ) -> Plan:
        plan = super().plan(query, blocks, rid=rid, scope=scope)
        self.windows.append(plan)
        return plan


@pytest.mark.parametrize("capacity", [None, 400])
def test_window_zero_is_the_online_run(capacity: int | None) -> None:
    prepared = _prepared(LISTS)
    online = run_method(
        "contextpilot",
        prepared,
        mode="online",
        engine_factory=lambda: EmbeddedEngine(capacity, counter=COUNTER),
    )
    windowed = run_window(
        prepared,
        poisson_arrivals(len(LISTS), 5000.0, seed=3),
        WindowPolicy(0.0),
        engine_factory=lambda: EmbeddedEngine(capacity, counter=COUNTER),
    )
    assert windowed.window_sizes == [1] * len(LISTS)
    assert windowed.result.method == window_method(0) == "window 0 ms"
    assert windowed.result.records == online.records
    assert windowed.result.cache == online.cache


def test_a_joint_window_is_sent_in_schedule_order_and_windows_in_closing_order() -> None:
    prepared = _prepared(LISTS)
    arrivals = poisson_arrivals(len(LISTS), 2000.0, seed=5)
    policy = WindowPolicy(0.010, max_batch=8, adaptive=False)
    engines: list[_RecordingEngine] = []
    pilots: list[_SpyPilot] = []

    def engine_factory() -> Engine:
        engines.append(_RecordingEngine(None))
        return engines[-1]

    def pilot_factory(engine: Engine) -> ContextPilot:
        pilots.append(_SpyPilot())
        return pilots[-1]

    result = run_window(
        prepared, arrivals, policy, engine_factory=engine_factory, pilot_factory=pilot_factory
    )
    anonymous = [PlanRequest("q", ["b"]) for _ in LISTS]  # max_batch and time decide here
    groups = policy.group(list(zip(arrivals.times_s.tolist(), anonymous, strict=True)))
    assert result.window_sizes == [len(members) for _, members in groups]
    assert max(result.window_sizes) == 8 and min(result.window_sizes) >= 1
    assert any(size > 1 for size in result.window_sizes)
    expected: list[str] = []
    for planned in pilots[0].windows:
        if isinstance(planned, BatchPlan):
            expected += [plan.rid for plan in planned.scheduled()]
        else:
            expected.append(planned.rid)
    assert engines[0].sent == expected == [r.rid for r in result.result.records]
    # Each window's requests are its members; all requests go out once.
    assert sorted(r.request_index for r in result.result.records) == list(range(len(LISTS)))
    first = pilots[0].windows[0]
    assert isinstance(first, BatchPlan)
    assert {p.rid for p in first.plans} == {f"contextpilot-r{i}" for i in groups[0][1]}


def test_joint_planning_gains_on_a_small_cache() -> None:
    prepared = _prepared(LISTS, doc_len=200)
    factory = lambda: EmbeddedEngine(300, counter=COUNTER)  # noqa: E731
    spaced = _arrivals([i / 10 for i in range(60)])
    online = run_window(prepared, spaced, WindowPolicy(0.0), engine_factory=factory)
    together = run_window(
        prepared,
        _arrivals([0.0] * 60),
        WindowPolicy(0.010, max_batch=64, adaptive=False),
        engine_factory=factory,
    )
    assert together.window_sizes == [60]
    assert together.result.hit_ratio > online.result.hit_ratio


def test_added_latency_is_the_wait_for_the_window_plus_its_planning_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a clock that only planning advances (3 ms a window), the added latency is exactly
    (close - arrival) + 3 ms."""
    now = [0.0]

    class _Clock:
        @staticmethod
        def perf_counter() -> float:
            return now[0]

    class _SlowPilot(ContextPilot):
        def plan_batch(self, requests: Sequence[PlanRequest]) -> BatchPlan:
            now[0] += 0.003
            return super().plan_batch(requests)

        def plan(self, query, blocks, *, rid=None, scope=None) -> Plan:  # type: ignore[no-untyped-def]
            now[0] += 0.003
            return super().plan(query, blocks, rid=rid, scope=scope)

    monkeypatch.setattr(window_runner, "time", _Clock)
    prepared = _prepared(LISTS[:6])
    times = [0.000, 0.002, 0.004, 0.030, 0.031, 0.100]
    policy = WindowPolicy(0.010, max_batch=64, adaptive=False)
    result = run_window(
        prepared,
        _arrivals(times),
        policy,
        engine_factory=lambda: EmbeddedEngine(None, counter=COUNTER),
        pilot_factory=lambda engine: _SlowPilot(token_counter=COUNTER),
    )
    # Windows: [0, 2, 4] ms closing at 10 ms, [30, 31] closing at 40, [100] closing at 110.
    assert result.window_sizes == [3, 2, 1]
    np.testing.assert_allclose(result.window_plan_ms, [3.0, 3.0, 3.0])
    np.testing.assert_allclose(result.added_latency_ms, [13.0, 11.0, 9.0, 13.0, 12.0, 13.0])
    assert result.latency_percentile(50) == pytest.approx(12.5)
    assert result.requests_per_window == 2.0
    assert result.result.plan_seconds == pytest.approx(0.009)


def test_times_must_match_the_requests() -> None:
    with pytest.raises(ValueError, match="2 arrival times for 3 requests"):
        run_window(
            _prepared([[0], [1], [2]]),
            _arrivals([0.0, 1.0]),
            WindowPolicy(0.0),
            engine_factory=lambda: EmbeddedEngine(None, counter=COUNTER),
        )


def test_reordered_workload_follows_the_arrival_order() -> None:
    prepared = _prepared([[0], [1], [2]])
    moved = prepared.reordered([2, 0, 1])
    assert [r.id for r in moved.workload.requests] == ["r2", "r0", "r1"]
    assert moved.block_texts(0) == prepared.block_texts(2)
    assert prepared.reordered([0, 1, 2]) is prepared
    with pytest.raises(ValueError, match="permutation"):
        prepared.reordered([0, 0, 1])
