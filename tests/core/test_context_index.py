"""Invariants of the context index: property tests against a brute-force model."""

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.index.context_index import ContextIndex

contexts_strategy = st.lists(
    st.lists(st.integers(0, 12), min_size=1, max_size=6, unique=True), min_size=1, max_size=25
)


def _check_structure(index: ContextIndex) -> None:
    """Compressed radix tree: every non-root node has blocks, and is a leaf with a request,
    or has a request, or has >= 2 children; children keyed by their first block."""
    for node in index._tree.nodes.values():
        for key, child in node.children.items():
            assert child.blocks and child.blocks[0] == key and child.parent is node
        if node is index._tree.root:
            continue
        assert node.blocks
        assert node.rids or len(node.children) >= 2
    for rid, request in index._requests.items():
        # The path of the node spells out the context.
        spelled = []
        for node_id in index.search_path(rid):
            spelled.extend(index._tree.nodes[node_id].blocks)
        assert tuple(spelled) == request.blocks


@settings(max_examples=150, deadline=None)
@given(contexts_strategy, st.data())
def test_insert_evict_keep_tree_equal_to_live_contexts(contexts, data):
    index = ContextIndex(max_requests=None)
    live = {}
    for i, context in enumerate(contexts):
        index.insert(f"r{i}", context)
        live[f"r{i}"] = tuple(context)
        if data.draw(st.booleans()):
            victim = data.draw(st.sampled_from(sorted(live)))
            assert index.evict(victim)
            del live[victim]
            assert not index.evict(victim)
        _check_structure(index)
    assert {r: index.context(r) for r in index.rids()} == live
    # Tokens held = distinct prefixes (the union of all live prefixes), as a prefix cache holds.
    prefixes = {c[:n] for c in live.values() for n in range(1, len(c) + 1)}
    assert index.stats().tokens == len(prefixes)


@settings(max_examples=150, deadline=None)
@given(contexts_strategy, st.lists(st.integers(0, 12), min_size=1, max_size=6, unique=True))
def test_search_matches_only_live_prefixes(contexts, query):
    index = ContextIndex(max_requests=None)
    for i, context in enumerate(contexts):
        index.insert(f"r{i}", context)
    for i in range(0, len(contexts), 2):
        index.evict(f"r{i}")
    found = index.search(query)
    live = [index.context(r) for r in index.rids()]
    assert set(found.prefix) <= set(query)
    if found.prefix:
        assert any(c[: len(found.prefix)] == found.prefix for c in live)
    # Greedy descent never misses a whole first block: if some live context starts with a
    # query block, the match is non-empty.
    if any(c[0] in query for c in live):
        assert found.prefix


def test_search_cut_short_by_its_budget_expands_children_in_the_budgets_order():
    # Two branches under the root, "a" (inserted first) and "b"; the longest match, a y,
    # lies under "a". With a budget of two nodes the root and one branch are expanded: the
    # last child stacked, "b" (the children's own order, stacked depth first), so the match is
    # b x; a walk in any other order, or one that overran the budget, would answer a y.
    a, b, x, y, z, w = 1, 2, 3, 4, 5, 6
    weights = {a: 1, b: 1, x: 1, y: 5}
    for budget, expected in ((2, (b, x)), (3, (a, y)), (256, (a, y))):
        index = ContextIndex(max_requests=None, search_budget=budget)
        for rid, context in (("r1", [a, y]), ("r2", [a, z]), ("r3", [b, x]), ("r4", [b, w])):
            index.insert(rid, context)
        found = index.search(list(weights), list(weights.values()))
        assert (found.prefix, found.prefix_tokens) == (expected, sum(weights[k] for k in expected))


@settings(max_examples=50, deadline=None)
@given(contexts_strategy, st.integers(1, 5))
def test_lru_bound_keeps_most_recent(contexts, bound):
    evicted = []
    index = ContextIndex(max_requests=bound, on_evict=evicted.append)
    for i, context in enumerate(contexts):
        index.insert(f"r{i}", context)
        assert len(index) <= bound
    expected = [f"r{i}" for i in range(len(contexts))][-bound:]
    assert index.rids() == expected
    assert evicted == [f"r{i}" for i in range(max(0, len(contexts) - bound))]


def test_token_bound_and_touch_order():
    index = ContextIndex(max_requests=None, max_tokens=10)
    index.insert("a", [1, 2], [3, 3])
    index.insert("b", [3, 4], [2, 2])
    index.touch("a")
    index.insert("c", [5], [4])  # 6 + 4 + 4 > 10: the least recently used ("b") goes
    assert index.rids() == ["a", "c"]
    assert index.stats().tokens == 10


def test_snapshot_restore_round_trip():
    index = ContextIndex()
    index.insert("a", [1, 2, 3], [5, 6, 7])
    index.insert("b", [1, 2, 9], [5, 6, 1])
    index.insert("c", [2**64 - 1, 4], [1, 1])
    copy = ContextIndex.restore(index.snapshot())
    assert copy.rids() == index.rids()
    assert all(copy.context(r) == index.context(r) for r in index.rids())
    assert copy.stats().tokens == index.stats().tokens
    with pytest.raises(ValueError, match="version"):
        ContextIndex.restore({"version": 99})


@pytest.mark.parametrize(
    ("blocks", "tokens", "message"),
    [([], None, "empty context"), ([1, 1], None, "appears twice"), ([1, 2], [1], "entries")],
)
def test_insert_rejects_bad_contexts(blocks, tokens, message):
    index = ContextIndex()
    with pytest.raises(ValueError, match=message):
        index.insert("r", blocks, tokens)
    assert len(index) == 0


def test_insert_rejects_duplicate_and_empty_rid():
    index = ContextIndex()
    index.insert("r", [1])
    with pytest.raises(ValueError, match="already indexed"):
        index.insert("r", [2])
    with pytest.raises(ValueError, match="rid"):
        index.insert("", [2])
    with pytest.raises(KeyError):
        index.search_path("missing")


def test_node_ids_start_at_one_and_evicted_paths_stay_valid():
    index = ContextIndex()
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2, 4])
    assert 0 not in index.search_path("a")
    index.evict("a")  # the {1,2} node merges with b's leaf
    assert len(index.search_path("b")) == 1
    assert index.search([1, 2, 4]).prefix == (1, 2, 4)


def test_concurrent_inserts_and_evictions_are_consistent():
    index = ContextIndex(max_requests=None)

    def worker(t: int) -> None:
        for i in range(300):
            rid = f"t{t}-{i}"
            index.insert(rid, [t, i % 7 + 100, i + 1000])
            if i % 3 == 0:
                index.evict(rid)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(index) == 4 * 200
    _check_structure(index)
