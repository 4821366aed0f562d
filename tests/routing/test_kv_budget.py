"""A replica's known KV capacity: what its index believes cached is bounded at planning time
(shared prefixes once, least recently planned first out), ahead of the engine's events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import PlanRequest
from contextpilot_integrations.core.replicas.kv_budget import KvBudget
from contextpilot_integrations.core.replicas.routing import ReplicaRouter
from contextpilot_integrations.core.replicas.routing_config import ReplicaSpec


def doc(name: str, words: int = 60) -> str:
    return f"{name}: " + " ".join(f"{name}-word{i}" for i in range(words))


def test_shared_prefixes_count_once_and_the_least_recently_planned_goes_first() -> None:
    budget = KvBudget(100)
    assert budget.add("r1", [(1, 30), (2, 30)], 70) == []  # 60 block tokens + 10 its own
    assert budget.add("r2", [(1, 30), (3, 20)], 55) == []  # shares block 1's prefix: +20+5
    assert budget.used_tokens == 95
    # The same block after another first block is another prefix: it counts again.
    assert budget.add("r3", [(2, 30)], 30) == ["r1"]  # 126 > 100: r1 leaves (its 2, its own)
    assert (budget.used_tokens, len(budget), budget.dropped) == (86, 2, 1)
    assert budget.discard("r2") and not budget.discard("r2")
    assert budget.used_tokens == 31 and "r3" in budget  # at least a token of its own
    # One request larger than the cache is kept (alone): it is what was just planned.
    assert budget.add("big", [(9, 500)], 500) == ["r3"] and len(budget) == 1
    # A request without blocks still weighs a token: the budget keeps at most 100 of them.
    small = KvBudget(100)
    for i in range(150):
        small.add(f"e{i}", [], 0)
    assert len(small) == 100 and small.dropped == 50
    with pytest.raises(ValueError, match="kv_capacity_tokens must be an int > 0, got 0"):
        KvBudget(0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.booleans()),
        max_size=25,
    )
)
def test_the_budget_matches_a_recount_and_holds_its_capacity(steps) -> None:
    budget, held, tokens = KvBudget(40), {}, 10
    for i, (blocks, evict) in enumerate(steps):
        if evict and held:
            rid = sorted(held)[0]
            assert budget.discard(rid)
            del held[rid]
            continue
        rid = f"r{i}"
        path = [(b, tokens) for b in blocks]
        for dropped in budget.add(rid, path, tokens * len(blocks) + 1):
            del held[dropped]
        held[rid] = blocks
        prefixes = {tuple(b[: j + 1]) for b in held.values() for j in range(len(b))}
        assert budget.used_tokens == tokens * len(prefixes) + len(held)  # a token of its own
        assert budget.used_tokens <= 40 or len(held) == 1
        assert set(held) == {r for r in held if r in budget} and len(budget) == len(held)


def test_a_window_planned_while_the_last_still_waits_believes_only_what_fits() -> None:
    docs = [doc(f"D{i}") for i in range(8)]
    one = docs[0]

    def router(capacity: int | None) -> ReplicaRouter:
        return ReplicaRouter([{"name": "a", "kv_capacity_tokens": capacity}])

    capped, believing = router(300), router(None)
    size = capped.token_counter.count(one)
    assert 2 * size < 300 < 3 * size  # two documents fit, three do not
    for r in (capped, believing):
        r.plan_batch([PlanRequest("q1", [one, docs[1]], "w1-a")])
        # The next window: three other documents, planned before the engine served w1-a.
        r.plan_batch([PlanRequest("q2", docs[2:5], "w2-a")])
    # Without the capacity the index still believes w1-a cached and the next call aligns to
    # it; with it, w1-a left the index when w2-a was planned (no engine event yet).
    assert believing.plan("q3", [docs[6], one]).matched_prefix_blocks == 1
    plan = capped.plan("q3", [docs[6], one])
    assert plan.matched_prefix_blocks == 0
    stats = capped.stats()["replicas"]["a"]
    assert stats["kv_budget"]["dropped"] >= 1 and stats["kv_budget"]["capacity_tokens"] == 300
    assert believing.stats()["replicas"]["a"]["kv_budget"] is None
    assert stats["kv_budget"]["requests"] == 1  # q3 alone: w2-a's three documents left too
    # An engine eviction frees the budget too.
    capped.evict(plan.rid)
    assert capped.stats()["replicas"]["a"]["kv_budget"]["requests"] == 0


def test_the_capacity_is_checked_and_read_from_a_mapping() -> None:
    spec = ReplicaSpec.from_mapping({"name": "a", "kv_capacity_tokens": 4096})
    assert spec.kv_capacity_tokens == 4096
    for bad in (0, -1, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="replica 'a': kv_capacity_tokens must be"):
            ReplicaSpec("a", kv_capacity_tokens=bad)  # type: ignore[arg-type]


def test_the_engines_evictions_leave_the_budget_too() -> None:
    from contextpilot_integrations.sync.engine_link import EngineLink

    # The engine link (a capacity model standing in for an engine's KV events) evicts before
    # the budget would: what it drops leaves the budget as well as the index.
    router = ReplicaRouter(
        [{"name": "a", "kv_capacity_tokens": 100_000,
          "cache_sync": {"kind": "capacity", "capacity_tokens": 400}}],
        link_factory=EngineLink,
    )  # fmt: skip
    with router:
        for i in range(6):
            router.plan(f"q{i}", [doc(f"E{i}"), doc(f"F{i}")])
        stats = router.stats()["replicas"]["a"]
    assert stats["index"]["requests"] < 6
    assert stats["kv_budget"]["requests"] == stats["index"]["requests"]
    assert stats["kv_budget"]["dropped"] == 0  # the engine's evictions, not the budget's


def test_a_call_that_landed_elsewhere_moves_to_that_replicas_budget() -> None:
    router = ReplicaRouter(
        [{"name": "a", "kv_capacity_tokens": 5_000}, {"name": "b", "kv_capacity_tokens": 5_000}]
    )
    plan = router.plan("q", [doc("L1"), doc("L2")])
    moved_to = "b" if plan.replica == "a" else "a"
    router.landed(plan.rid, moved_to)
    budgets = {n: r["kv_budget"]["requests"] for n, r in router.stats()["replicas"].items()}
    assert budgets == {plan.replica: 0, moved_to: 1}
    indexed = {n: r["index"]["requests"] for n, r in router.stats()["replicas"].items()}
    assert indexed == budgets  # the index entry moved with it
