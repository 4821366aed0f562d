"""The one bounded LRU: bounds, recency, weights, against a plain reference model."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.core.lru import LRU

operations = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "peek", "pop", "touch"]),
        st.integers(0, 9),
        st.integers(0, 5),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(1, 5), st.one_of(st.none(), st.integers(1, 12)))
def test_matches_a_reference_model(ops, max_entries, max_weight):
    lru: LRU[int, int] = LRU(max_entries, max_weight=max_weight, weight=lambda v: v)
    model: list[tuple[int, int]] = []  # least recently used first
    for op, key, value in ops:
        keys = [k for k, _ in model]
        if op == "put":
            model = [(k, v) for k, v in model if k != key] + [(key, value)]
            expected = []
            while len(model) > 1 and (
                len(model) > max_entries
                or (max_weight is not None and sum(v for _, v in model) > max_weight)
            ):
                expected.append(model.pop(0))
            assert lru.put(key, value) == expected
        elif op in ("get", "touch"):
            result = lru.get(key) if op == "get" else lru.touch(key)
            if key in keys:
                entry = model.pop(keys.index(key))
                model.append(entry)
                assert result == (entry[1] if op == "get" else True)
            else:
                assert result == (None if op == "get" else False)
        elif op == "peek":
            assert lru.peek(key) == dict(model).get(key)
        else:
            assert lru.pop(key) == dict(model).get(key)
            model = [(k, v) for k, v in model if k != key]
        assert list(lru.items()) == model
        assert lru.total_weight == sum(v for _, v in model)
        assert lru.oldest() == (model[0] if model else None)


def test_bad_bounds_and_empty_pops():
    with pytest.raises(ValueError, match="max_entries must be a positive int"):
        LRU(0)
    with pytest.raises(ValueError, match="max_weight needs a weight function"):
        LRU(max_weight=3)
    with pytest.raises(KeyError, match="empty"):
        LRU().pop_oldest()


def test_an_entry_heavier_than_the_bound_is_kept_alone_and_reweigh_applies_bounds():
    lru: LRU[str, list[int]] = LRU(max_weight=5, weight=len)
    assert lru.put("a", [1, 2]) == []
    assert lru.put("big", [0] * 9) == [("a", [1, 2])]
    assert list(lru) == ["big"]
    lru.put("c", [1])
    assert list(lru) == ["c"]
    lru.put("d", [1])
    value = lru.peek("c")
    assert value is not None
    value.extend([2, 3, 4, 5])
    assert lru.reweigh("c", 1) == [("d", [1])]
    assert lru.total_weight == 5


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), max_size=20),
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), max_size=6),
    st.integers(1, 12),
)
def test_put_many_puts_every_item_then_applies_the_bound_once(before, batch, max_entries):
    lru: LRU[int, int] = LRU(max_entries)
    for key, value in before:
        lru.put(key, value)
    old = [(k, v) for k, v in lru.items() if k not in {key for key, _ in batch}]
    order = list(dict.fromkeys(key for key, _ in reversed(batch)))[::-1]  # by their last put
    fresh = [(key, dict(batch)[key]) for key in order]
    keep = max(max_entries, len(fresh)) - len(fresh)
    dropped = old[: max(0, len(old) - keep)]
    assert lru.put_many(batch) == dropped
    assert list(lru.items()) == old[len(dropped) :] + fresh


def test_map_values_keeps_the_order_of_use_and_the_weights() -> None:
    lru: LRU[str, int] = LRU(max_weight=100, weight=lambda v: v)
    for key, value in (("a", 1), ("b", 2), ("c", 3)):
        lru.put(key, value)
    lru.touch("a")
    lru.map_values(lambda v: v * 10)
    assert list(lru.items()) == [("b", 20), ("c", 30), ("a", 10)] and lru.total_weight == 60


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5)), max_size=8),
    st.lists(st.integers(0, 12), max_size=6, unique=True),
    st.integers(1, 12),
)
def test_add_to_many_is_put_many_of_the_sums(before, keys, max_entries):
    added: LRU[int, float] = LRU(max_entries)
    put: LRU[int, float] = LRU(max_entries)
    for key, value in before:
        added.put(key, float(value))
        put.put(key, float(value))
    dropped = put.put_many([(key, put.peek(key, 0.0) + 1.5) for key in keys])
    assert added.add_to_many(keys, 1.5) == dropped
    assert list(added.items()) == list(put.items())
