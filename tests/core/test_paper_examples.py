"""The worked examples of the ContextPilot paper (sections 4.1-4.3)."""

from contextpilot_integrations.core.index.context_index import ContextIndex
from contextpilot_integrations.core.ordering.clustering import order_batch
from contextpilot_integrations.core.ordering.distance import context_distance
from contextpilot_integrations.core.ordering.scheduling import schedule_by_first_step


def _build(contexts, method="cluster"):
    index = ContextIndex()
    orders = order_batch(contexts, method=method)
    for i, order in enumerate(orders):
        index.insert(f"C{i + 1}", order)
    return index, orders


def _node_blocks(index, rid):
    """Cumulative block sets along rid's search path (one set per node)."""
    context = index.context(rid)
    sets, depth = [], 0
    for node_id in index.search_path(rid):
        depth += len(index._tree.nodes[node_id].blocks)
        sets.append(set(context[:depth]))
    return sets


def test_build_creates_intersection_nodes_1_2_and_1():
    for method in ("cluster", "frequency"):
        index, orders = _build([[2, 1, 3], [2, 6, 1], [4, 1, 0]], method)
        assert orders == [[1, 2, 3], [1, 2, 6], [1, 4, 0]]
        assert _node_blocks(index, "C1")[:2] == [{1}, {1, 2}]
        assert _node_blocks(index, "C2")[:2] == [{1}, {1, 2}]
        assert _node_blocks(index, "C3")[0] == {1}


def test_search_stops_at_the_1_2_node_and_inserts_there():
    index, _ = _build([[2, 1, 3], [2, 6, 1], [4, 1, 0]])
    found = index.search([2, 1, 4])
    assert set(found.prefix) == {1, 2} and not found.partial
    node_1_2 = found.node_id
    index.insert("C4", [*found.prefix, 4])
    assert index.search_path("C4")[:-1] == index.search_path("C1")[:-1]
    assert index.search_path("C4")[-2] == node_1_2


def test_ordering_puts_shared_prefix_first_and_leaves_unshared_context_alone():
    contexts = [[2, 1, 3], [2, 6, 1], [4, 2, 1], [9, 1, 2], [5, 7, 8]]
    for method in ("cluster", "frequency"):
        orders = order_batch(contexts, method=method)
        # The paper writes the results as sets: {1,2,3}, {1,2,6}, {1,2,4}, {1,2,9}; what matters
        # is one shared prefix holding {1, 2} in the same order, then each context's own block.
        shared = orders[0][:2]
        assert set(shared) == {1, 2}
        assert [o[:2] for o in orders[:4]] == [shared] * 4
        assert [o[2] for o in orders[:4]] == [3, 6, 4, 9]
        assert orders[4] == [5, 7, 8]


def test_schedule_groups_by_first_step_longest_path_first():
    paths = {"C6": (1, 3, 4), "C3": (2, 5), "C7": (2,), "C8": (1, 6)}
    names = list(paths)
    order = schedule_by_first_step([paths[n] for n in names])
    assert [names[i] for i in order] == ["C6", "C8", "C3", "C7"]


def test_distance_b_to_d_smaller_than_b_to_a():
    a, b, d = [3, 5, 1, 7], [2, 6, 3, 5], [2, 6, 4, 0]
    assert context_distance(b, d) < context_distance(b, a)
    assert context_distance(b, d) == 0.5  # shares 2 of 4 at equal positions
    assert context_distance([1, 2], [3, 4]) == 1.0
