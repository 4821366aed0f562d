"""The radix-tree cache model against a brute-force reference on small random request streams.

The reference keeps every cached prefix (a tuple of units) in a dict, with a flag saying whether
the prefix starts a new radix node, and recomputes nodes, leaves and LRU order from scratch on
every step. It shares no code with the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from hypothesis import given, settings
from hypothesis import strategies as st


@dataclass
class _Entry:
    weight: int
    time: int
    starts_node: bool
    rids: list[str] = field(default_factory=list)


class BruteForceCache:
    """Same semantics as PrefixCacheModel, spelled out over the set of cached prefixes."""

    def __init__(self, capacity: int | None, block_size: int = 1) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.cached: dict[tuple, _Entry] = {}
        self.clock = 0
        self.evicted_rids: list[str] = []

    def used(self) -> int:
        return sum(e.weight for e in self.cached.values())

    def children(self, prefix: tuple) -> list[tuple]:
        return [p for p in self.cached if len(p) == len(prefix) + 1 and p[:-1] == prefix]

    def nodes(self) -> list[list[tuple]]:
        """Each radix node as its chain of prefixes (first one starts the node)."""
        out = []
        for p, e in self.cached.items():
            if not e.starts_node:
                continue
            chain = [p]
            while True:
                nxt = [c for c in self.children(chain[-1]) if not self.cached[c].starts_node]
                assert len(nxt) <= 1
                if not nxt:
                    break
                chain.append(nxt[0])
            out.append(chain)
        return out

    def serve(self, units: tuple, weights: tuple, rid: str | None) -> int:
        self.clock += 1
        now = self.clock
        matched = 0
        while matched < len(units) and units[: matched + 1] in self.cached:
            matched += 1
        # A match that ends inside a node splits it.
        for c in self.children(units[:matched]):
            if not self.cached[c].starts_node:
                self.cached[c].starts_node = True
        for i in range(1, matched + 1):
            self.cached[units[:i]].time = now
        need = sum(weights[matched:])
        if self.capacity is not None and need:
            overflow = self.used() + need - self.capacity
            freed = 0
            while freed < overflow:
                leaves = [
                    chain
                    for chain in self.nodes()
                    if not self.children(chain[-1]) and chain[-1] != units[:matched]
                ]
                if not leaves:
                    break
                victim = min(leaves, key=lambda chain: self.cached[chain[0]].time)
                for p in victim:
                    entry = self.cached.pop(p)
                    freed += entry.weight
                    self.evicted_rids.extend(entry.rids)
        end = matched
        budget = None if self.capacity is None else self.capacity - self.used()
        total = 0
        for i in range(matched, len(units)):
            if budget is not None and total + weights[i] > budget:
                break
            total += weights[i]
            self.cached[units[: i + 1]] = _Entry(weights[i], now, starts_node=(i == matched))
            end = i + 1
        if rid is not None and end > 0:
            self.cached[units[:end]].rids.append(rid)
        matched_tokens = sum(weights[:matched])
        cached = min(matched_tokens, max(sum(weights) - 1, 0))
        return cached - cached % self.block_size


def _weight_of(unit: int) -> int:
    # Same unit, same weight (as a segment's block id and its token count).
    return 1 + (unit * 7) % 5


_prompts = st.lists(st.integers(0, 5), min_size=0, max_size=7)
_streams = st.lists(_prompts, min_size=1, max_size=25)


@settings(max_examples=400, deadline=None)
@given(
    stream=_streams,
    capacity=st.one_of(st.none(), st.integers(0, 40)),
    block_size=st.integers(1, 4),
    weighted=st.booleans(),
)
def test_model_matches_brute_force(
    stream: list[list[int]], capacity: int | None, block_size: int, weighted: bool
) -> None:
    model = PrefixCacheModel(capacity, block_size=block_size)
    reference = BruteForceCache(capacity, block_size=block_size)
    for step, prompt in enumerate(stream):
        units = tuple(prompt)
        weights = tuple(_weight_of(u) if weighted else 1 for u in units)
        rid = f"r{step}"
        got = model.serve(units, weights, rid=rid)
        want = reference.serve(units, weights, rid)
        assert got == want, f"step {step}: cached {got} != reference {want}"
        stats = model.stats()
        assert stats.used_tokens == reference.used()
        assert stats.nodes == len(reference.nodes())
        assert sorted(model.take_evicted_rids()) == sorted(reference.evicted_rids)
        reference.evicted_rids.clear()
        if capacity is not None:
            assert stats.used_tokens <= capacity


@settings(max_examples=200, deadline=None)
@given(stream=_streams)
def test_unlimited_cache_hits_are_longest_common_prefix_with_history(
    stream: list[list[int]],
) -> None:
    """With no capacity limit, a hit is the longest common prefix with any earlier prompt."""
    model = PrefixCacheModel(None)
    seen: list[tuple[int, ...]] = []
    for prompt in stream:
        units = tuple(prompt)
        best = 0
        for old in seen:
            n = 0
            while n < min(len(old), len(units)) and old[n] == units[n]:
                n += 1
            best = max(best, n)
        assert model.match_tokens(units) == best
        assert model.serve(units) == min(best, max(len(units) - 1, 0))
        seen.append(units)


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    model = PrefixCacheModel(capacity_tokens=6)
    assert model.serve(["s", "a", "b"]) == 0  # s-a-b
    assert model.serve(["s", "c", "d"]) == 1  # split: s | a-b, c-d ; used 5
    assert model.serve(["s", "a", "b", "e"]) == 3  # touches s and a-b; used 6
    # Needs 2 more tokens: c-d is the least recently used leaf and goes, whole.
    assert model.serve(["s", "f", "g"]) == 1
    stats = model.stats()
    assert stats.evicted_tokens == 2 and stats.evicted_nodes == 1
    assert model.match_tokens(["s", "c", "d"]) == 1
    assert model.match_tokens(["s", "a", "b", "e"]) == 4


def test_parent_becomes_evictable_when_childless_and_rids_are_reported() -> None:
    model = PrefixCacheModel(capacity_tokens=4)
    model.serve(["a", "b"], rid="first")
    model.serve(["a", "b", "c"], rid="second")  # a-b then child c
    model.serve(["x", "y", "z"], rid="third")  # needs 3, 1 free: evict c, then a-b
    assert sorted(model.take_evicted_rids()) == ["first", "second"]
    assert model.take_evicted_rids() == []
    assert model.match_tokens(["a", "b"]) == 0
    assert model.stats().used_tokens == 3


def test_running_request_prefix_is_never_evicted_and_oversize_prompt_is_truncated() -> None:
    model = PrefixCacheModel(capacity_tokens=3)
    model.serve(["a", "b"])
    # Its own prefix a-b is protected; only 1 token of the rest fits.
    assert model.serve(["a", "b", "c", "d", "e"]) == 2
    assert model.match_tokens(["a", "b", "c", "d", "e"]) == 3
    assert model.stats().truncated_inserts == 1


def test_block_size_counts_whole_blocks_and_last_token_is_recomputed() -> None:
    model = PrefixCacheModel(None, block_size=4)
    model.serve(list(range(10)))
    assert model.serve(list(range(10))) == 8  # 9 tokens may hit, 2 whole blocks
    assert model.serve(list(range(6)) + [99]) == 4
    weighted = PrefixCacheModel(None)
    weighted.serve([1, 2], [100, 50])
    assert weighted.serve([1, 2], [100, 50]) == 149
    assert weighted.serve([1, 3], [100, 7]) == 100
    assert weighted.stats().hit_ratio == pytest.approx(249 / 407)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((-1,), ValueError),
        ((10, 0), ValueError),
        ((1.5,), TypeError),
        ((10, 2.0), TypeError),
    ],
)
def test_bad_construction(args: tuple, error: type[Exception]) -> None:
    with pytest.raises(error):
        PrefixCacheModel(*args)


def test_bad_weights() -> None:
    model = PrefixCacheModel(None)
    with pytest.raises(ValueError, match="weights has 1 entries but units has 2"):
        model.serve([1, 2], [3])
    with pytest.raises(ValueError, match=r"weights\[1\] must be >= 0"):
        model.serve([1, 2], [3, -1])
    with pytest.raises(TypeError, match=r"weights\[0\] must be an int"):
        model.serve([1], [2.5])
