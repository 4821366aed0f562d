"""Batch scheduling: the prefix-tree walk, and what the index held before the batch first."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contextpilot_integrations.core.ordering.scheduling import schedule, schedule_by_prefix_tree
from contextpilot_integrations.core.pilot import TAIL_BATCH_LIMIT, ContextPilot
from contextpilot_integrations.core.request import PlanRequest


def test_bigger_subtree_first_unless_a_smaller_one_holds_a_cached_prefix() -> None:
    paths = [[1, 2], [1, 3], [1], [4, 5]]
    assert schedule_by_prefix_tree(paths) == [2, 0, 1, 3]
    assert schedule_by_prefix_tree(paths, [0, 0, 0, 40]) == [3, 2, 0, 1]
    # within a subtree, too: the branch holding the cached prefix runs first
    assert schedule_by_prefix_tree(paths, [0, 30, 0, 0]) == [2, 1, 0, 3]
    assert schedule(paths, "prefix-tree", [0, 0, 0, 40]) == [3, 2, 0, 1]
    with pytest.raises(ValueError, match="cached has 2 entries for 4 paths"):
        schedule_by_prefix_tree(paths, [0, 1])


@given(st.lists(st.lists(st.integers(1, 6), max_size=4), max_size=12), st.data())
def test_every_request_is_scheduled_once(paths: list[list[int]], data: st.DataObject) -> None:
    cached = data.draw(st.lists(st.integers(0, 50), min_size=len(paths), max_size=len(paths)))
    assert sorted(schedule_by_prefix_tree(paths, cached)) == list(range(len(paths)))


def test_a_batch_runs_first_the_request_that_hits_what_the_index_holds() -> None:
    a, b, x = "shared block A " * 10, "shared block B " * 10, "cached block X " * 10
    pilot = ContextPilot()
    pilot.plan("earlier", [x, "earlier's own"])
    batch = pilot.plan_batch(
        [
            PlanRequest("q0", [a, b, "u0"]),
            PlanRequest("q1", [a, b, "u1"]),
            PlanRequest("q2", ["u2", x]),
        ]
    )
    assert batch.plans[2].matched_prefix_tokens > 0
    assert batch.schedule[0] == 2  # before the others push the cached prefix out
    assert abs(batch.schedule_positions[0] - batch.schedule_positions[1]) == 1


def test_the_request_later_ones_will_reuse_most_runs_last() -> None:
    paths = [[1, 2], [1, 3], [4], [5, 6], [5]]
    assert schedule_by_prefix_tree(paths) == [0, 1, 4, 3, 2]
    # its branch goes last at every level, so its prompt is what the cache keeps
    assert schedule_by_prefix_tree(paths, reuse=[0, 90, 0, 10, 0]) == [4, 3, 2, 0, 1]
    assert schedule(paths, "prefix-tree", None, [0, 0, 0, 0, 70]) == [0, 1, 2, 4, 3]
    # a request that hits a cached prefix still runs first, and is never the tail
    assert schedule_by_prefix_tree(paths, [0, 50, 0, 0, 0], [0, 90, 0, 0, 0]) == [1, 0, 4, 3, 2]
    # nothing expected to be reused: the walk as without it
    assert schedule_by_prefix_tree(paths, reuse=[0.0] * 5) == [0, 1, 4, 3, 2]
    with pytest.raises(ValueError, match="reuse has 1 entries for 5 paths"):
        schedule_by_prefix_tree(paths, reuse=[1.0])


def test_a_batch_ends_with_the_prompt_earlier_traffic_says_will_be_reused() -> None:
    popular, other = "popular block P " * 10, "other block O " * 10
    requests = [
        PlanRequest("q0", [other, "own 0"]),
        PlanRequest("q1", [other, "own 1"]),
        PlanRequest("q2", [popular, "own 2"]),
        PlanRequest("q3", ["own 3", "own 4"]),
    ]
    assert ContextPilot().plan_batch(requests).schedule[-1] != 2
    warmed = ContextPilot()
    warmed.warm_start([PlanRequest(f"past {i}", [popular, f"past {i}"]) for i in range(5)])
    assert warmed.plan_batch(requests).schedule[-1] == 2
    # a batch larger than a planning window keeps the walk as it is
    filler = [
        PlanRequest(f"f{i}", [f"filler {i}", f"filler {i}b"]) for i in range(TAIL_BATCH_LIMIT)
    ]
    large = ContextPilot()
    large.warm_start([PlanRequest(f"past {i}", [popular, f"past {i}"]) for i in range(5)])
    assert large.plan_batch([*requests, *filler]).schedule[-1] != 2
