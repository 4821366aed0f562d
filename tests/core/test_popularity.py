"""The popularity and co-occurrence memories of the online rest order."""

from __future__ import annotations

import pytest

from contextpilot_integrations.core.ordering.alignment import align
from contextpilot_integrations.core.ordering.popularity import CooccurrenceMemory, PopularityMemory


def test_scores_decay_by_half_life_and_survive_rebasing() -> None:
    memory = PopularityMemory(capacity=10, half_life=1.0)
    memory.add([1, 2])
    memory.add([1])
    assert memory.get(1) == pytest.approx(1.5)  # 1 now + 1 one half-life ago
    assert memory.get(2) == pytest.approx(0.5)
    memory._REBASE_AT = 4.0  # type: ignore[misc]  # force rebases every few requests
    for _ in range(20):
        memory.add([3])
    assert memory.get(3) == pytest.approx(2.0, rel=1e-6)  # 1 + 1/2 + 1/4 + ...
    assert memory.get(1) == pytest.approx(1.5 * 2.0**-20, rel=1e-6)
    assert PopularityMemory(0).get(5) == 0.0


def test_cooccurrence_forgets_beyond_its_horizon() -> None:
    memory = CooccurrenceMemory(horizon=2)
    memory.add([1, 2])
    memory.add([1, 3])
    assert memory.holders(1) == {1, 2} and memory.holders(2) == {1}
    memory.add([4])
    assert memory.holders(1) == {2} and memory.holders(2) == frozenset()
    with pytest.raises(ValueError, match="cooccurrence_memory"):
        CooccurrenceMemory(-1)


def test_the_rest_follows_what_requests_holding_the_prefix_held_next() -> None:
    memory = CooccurrenceMemory(horizon=100)
    for _ in range(3):
        memory.add([10, 20, 30])  # requests with 10 go on with 20, then 30
    memory.add([10, 20])
    for _ in range(5):
        memory.add([40, 50])  # 40 and 50 are more popular, but never beside 10
    popularity = {10: 3, 20: 3, 30: 3, 40: 5, 50: 5}.get
    order = align(
        [50, 30, 10, 40, 20],
        [10],
        rest_order="co-occurrence",
        popularity=lambda b: float(popularity(b) or 0),
        holders=memory.held_by,
    )
    assert order[:3] == [10, 20, 30] and order[3:] == [50, 40]
    no_prefix = align(
        [30, 40, 50],
        [],
        rest_order="co-occurrence",
        popularity=lambda b: float(popularity(b) or 0),
        holders=memory.held_by,
    )
    assert no_prefix == [40, 50, 30]  # the most popular leads, then what it co-occurs with
    with pytest.raises(ValueError, match="needs a holders function"):
        align([1, 2], [], rest_order="co-occurrence", popularity=lambda b: 0.0)


def test_future_reuse_grows_with_the_cache_lifetime_and_the_prefix_frequency() -> None:
    memory = CooccurrenceMemory(horizon=10)
    for _ in range(4):
        memory.add([1, 2])
    for _ in range(4):
        memory.add([3])
    # Half the recent requests held [1, 2]: within one later request, half a chance.
    assert memory.future_reuse([1, 2], [10, 10], lifetime=1, depth=5) == pytest.approx(10.0)
    assert memory.future_reuse([1, 2], [10, 10], lifetime=20, depth=5) == pytest.approx(20.0)
    assert memory.future_reuse([2, 3], [10, 10], lifetime=20, depth=5) == pytest.approx(10.0)
    assert memory.future_reuse([9], [10], lifetime=20, depth=5) == 0.0
    assert memory.future_reuse([1, 2], [10, 10], lifetime=0, depth=5) == 0.0
    assert memory.future_reuse([1, 2], [10, 10], lifetime=20, depth=1) == pytest.approx(10.0)
