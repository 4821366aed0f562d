"""Tests of the offline bounds and the exact optimum (bench/bounds.py).

The exact optimum is checked against brute force over every ordering of tiny batches; the bounds
against the optimum on random batches (hypothesis): a bound that an ordering could exceed would
be worse than none.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from contextpilot_bench.bounds import (
    offline_bounds,
    prefix_intersection_bound,
    spanning_forest_bound,
    two_level_lp_bound,
)
from contextpilot_bench.engine import EmbeddedEngine
from contextpilot_bench.methods import PreparedWorkload, run_method
from contextpilot_bench.optimal_orders import connected_slices, optimal_orders
from contextpilot_bench.ordering_problem import (
    OrderingProblem,
    cached_tokens,
    ordering_problem,
    orders_of_plans,
)
from contextpilot_bench.workloads import Document, Request, Workload
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.blocks import ApproxTokenCounter
from contextpilot_integrations.core.ordering.clustering import order_batch
from contextpilot_integrations.core.pilot import ContextPilot
from contextpilot_integrations.core.rendering import PromptLayout
from contextpilot_integrations.core.request import PlanRequest


def _problem(sets: list[list[int]], weights: list[int], shared: int = 0) -> OrderingProblem:
    return OrderingProblem(
        tuple(tuple(s) for s in sets), np.asarray(weights, dtype=np.int64), shared
    )


@st.composite
def problems(draw: st.DrawFn, max_requests: int, max_units: int, pool: int) -> OrderingProblem:
    n = draw(st.integers(1, max_requests))
    weights = draw(st.lists(st.integers(1, 9), min_size=pool, max_size=pool))
    sets = [
        draw(st.lists(st.integers(0, pool - 1), min_size=1, max_size=max_units, unique=True))
        for _ in range(n)
    ]
    return _problem(sets, weights, draw(st.integers(0, 5)))


def _brute_force(problem: OrderingProblem) -> int:
    per_request = [list(itertools.permutations(units)) for units in problem.units]
    return max(cached_tokens(problem, orders) for orders in itertools.product(*per_request))


def _pairwise_bound(problem: OrderingProblem) -> int:
    """Today's bound: each request's best overlap with any other, plus the shared prefix."""
    n = problem.requests
    w = problem.unit_tokens
    total = 0
    for i in range(n):
        best = 0
        for j in range(n):
            if j != i:
                best = max(
                    best, int(sum(w[u] for u in set(problem.units[i]) & set(problem.units[j])))
                )
        total += best + (problem.shared_tokens if n > 1 else 0)
    return total


def _small_enough(problem: OrderingProblem) -> bool:
    return math.prod(math.factorial(len(u)) for u in problem.units) <= 3000


# --- the exact optimum -------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(problems(max_requests=5, max_units=3, pool=5))
def test_optimum_equals_brute_force_and_is_reached(problem: OrderingProblem) -> None:
    if not _small_enough(problem):
        return
    best = optimal_orders(problem)
    assert best.cached_tokens == _brute_force(problem)
    assert cached_tokens(problem, best.orders) == best.cached_tokens
    for order, units in zip(best.orders, problem.units):
        assert sorted(order) == sorted(units)


def test_optimum_of_a_known_batch() -> None:
    # {a,b}, {a,b}, {a}, {b}: the pair shares a and b, one single joins a; b's single is alone.
    problem = _problem([[0, 1], [0, 1], [0], [1]], [1, 1])
    assert optimal_orders(problem).cached_tokens == 3
    assert spanning_forest_bound(problem) == 4
    assert prefix_intersection_bound(problem) == 3  # floor(11/3)
    assert two_level_lp_bound(problem) == 3


def test_the_first_level_counts_whole_nodes() -> None:
    # A hub {a, b, c} and the singles {a}, {b}, {c}: the hub shares its first block with one
    # single only. Each single's prefix share counts the hub (1/2 each, and the hub 1/2 at its
    # first block), the spanning forest credits all three edges; the LP sees that the three
    # first-level nodes a, b, c are each paid once.
    problem = _problem([[0, 1, 2], [0], [1], [2]], [1, 1, 1])
    assert optimal_orders(problem).cached_tokens == 1
    assert spanning_forest_bound(problem) == 3
    assert prefix_intersection_bound(problem) == 2
    assert two_level_lp_bound(problem) == 1


def test_pairs_keep_an_integrality_gap() -> None:
    # Every pair of four blocks: each request picks one first block (the optimum shares
    # 6 - 3 = 3 of them); both the prefix bound and the LP (all four first-level nodes half
    # open) credit 4.
    pairs = [list(p) for p in itertools.combinations(range(4), 2)]
    problem = _problem(pairs, [1] * 4)
    assert optimal_orders(problem).cached_tokens == 3
    assert prefix_intersection_bound(problem) == 4
    assert two_level_lp_bound(problem) == 4


def test_optimum_refuses_a_large_batch() -> None:
    with pytest.raises(ValueError, match="at most"):
        optimal_orders(_problem([[0]] * 5, [1]), max_requests=4)


# --- the bounds hold ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(problems(max_requests=10, max_units=5, pool=8))
def test_bounds_are_never_below_the_optimum(problem: OrderingProblem) -> None:
    best = optimal_orders(problem).cached_tokens
    bounds = offline_bounds(problem)
    assert bounds.spanning_forest >= best
    assert bounds.prefix_intersection >= best
    assert bounds.two_level_lp is not None and bounds.two_level_lp >= best
    assert bounds.tighter >= best
    # The LP counts the first two levels whole: never looser than the prefix bound.
    assert bounds.two_level_lp <= bounds.prefix_intersection
    # The spanning forest is never above the best-pair bound.
    assert bounds.spanning_forest <= _pairwise_bound(problem)
    # Fewer exactly-ordered units only loosen the prefix bound.
    assert prefix_intersection_bound(problem, exact_units=1) >= bounds.prefix_intersection


@settings(max_examples=60, deadline=None)
@given(problems(max_requests=12, max_units=6, pool=10))
def test_library_orders_never_beat_the_optimum(problem: OrderingProblem) -> None:
    weights = [[int(problem.unit_tokens[u]) for u in units] for units in problem.units]
    best = optimal_orders(problem).cached_tokens
    for method in ("cluster", "frequency", "auto"):
        orders = order_batch(problem.units, weights, method=method)  # type: ignore[arg-type]
        assert cached_tokens(problem, orders) <= best


def test_lp_is_skipped_beyond_exact_units() -> None:
    problem = _problem([[0, 1, 2], [0, 1, 2]], [1, 1, 1])
    assert two_level_lp_bound(problem, exact_units=2) is None
    assert offline_bounds(problem, exact_units=2).tighter == prefix_intersection_bound(
        problem, exact_units=2
    )
    assert offline_bounds(problem, lp=False).two_level_lp is None


def test_cached_tokens_rejects_a_foreign_unit() -> None:
    problem = _problem([[0, 1], [1]], [2, 3])
    with pytest.raises(ValueError, match="sub-permutation"):
        cached_tokens(problem, [[0, 1], [0]])
    assert cached_tokens(problem, [[1, 0], [1]]) == 3


# --- slices and the real workloads --------------------------------------------------------------


def test_slices_are_connected_and_sized() -> None:
    sets = [[0, 1], [1, 2], [2, 3], [3, 4], [7], [8]]
    problem = _problem(sets, [1] * 9)
    slices = connected_slices(problem, 3, 5, seed=1)
    assert slices
    for s in slices:
        assert len(s) == 3 and 4 not in s and 5 not in s


def _tiny_workload() -> PreparedWorkload:
    docs = [Document(f"d{i}", f"document number {i} " + "text " * (3 + i)) for i in range(6)]
    queries = ["q one", "q two", "q one", "q three"]  # "q one" twice: the same request
    picks = [[0, 1, 2], [1, 2, 3], [0, 1, 2], [3, 4, 5, 5]]  # the last repeats a block
    workload = Workload(
        "tiny", tuple(docs), tuple(Request(f"r{i}", q) for i, q in enumerate(queries))
    )
    retrieved = [[docs[j] for j in p] for p in picks]
    return PreparedWorkload(workload, 4, retrieved, PromptLayout(), ApproxTokenCounter())


def test_problem_of_a_workload_and_the_library_within_it() -> None:
    prepared = _tiny_workload()
    problem = ordering_problem(prepared)
    assert problem.requests == 4
    assert problem.units[0] == problem.units[2]  # same blocks, same question: same units
    assert len(problem.units[3]) == 5  # 4 block units (the repeat is a second unit) + tail
    assert problem.shared_tokens == prepared.counter.count(prepared.layout.system_segment())
    layout, counter = prepared.layout, prepared.counter
    for (kind, text, _), u in problem.unit_ids.items():
        if kind == "block":
            assert problem.unit_tokens[u] == max(
                counter.count(layout.render_block(p, text)) for p in range(4)
            )
    requests = [
        PlanRequest(r.query, prepared.block_texts(i), f"t-{r.id}")
        for i, r in enumerate(prepared.workload.requests)
    ]
    with ContextPilot(layout=layout, token_counter=counter) as pilot:
        orders = orders_of_plans(problem, pilot.plan_batch(requests).plans)
    realised = run_method(
        "contextpilot",
        prepared,
        mode="offline",
        engine_factory=lambda: EmbeddedEngine(None, counter=counter),
    )
    model = cached_tokens(problem, orders)
    best = optimal_orders(problem).cached_tokens
    assert realised.cached_tokens <= model <= best <= offline_bounds(problem).tighter


def test_bounds_on_a_real_workload(data_dir) -> None:
    from contextpilot_bench.methods import prepare_workload, upper_bound_records
    from contextpilot_bench.workloads import load_workload

    prepared = prepare_workload(
        load_workload("multihop-rag", data_dir).head(80), 10, counter=ApproxTokenCounter()
    )
    problem = ordering_problem(prepared)
    bounds = offline_bounds(problem)
    library = run_method(
        "contextpilot",
        prepared,
        mode="offline",
        engine_factory=lambda: EmbeddedEngine(None, counter=prepared.counter),
    )
    loose = sum(r.cached_tokens or 0 for r in upper_bound_records(prepared))
    assert library.cached_tokens <= bounds.tighter < loose
    for indices in connected_slices(problem, 10, 3, seed=0):
        part = problem.restrict(indices)
        best = optimal_orders(part).cached_tokens
        assert best <= offline_bounds(part).tighter
