"""Paged mode of the prefix-cache model against vLLM v1's block pool, restated independently.

``BlockPoolReference`` re-implements the rules read from vLLM 0.32's ``v1/core/block_pool.py``
and ``kv_cache_manager.py`` directly (a free queue of block ids, full blocks cached under their
token chain), with none of the model's radix-tree machinery; the property test drives both with
the same request streams. ``tests/testbed/test_vllm_e2e.py`` checks the model against the real
engine.
"""

from __future__ import annotations

import pytest
from contextpilot_bench.prefix_cache_model import PrefixCacheModel
from hypothesis import given, settings
from hypothesis import strategies as st


class BlockPoolReference:
    """vLLM v1 prefix caching, restated: ``usable_blocks`` blocks of ``block_size`` tokens.

    - hit: the longest chain of cached full blocks within the first ``len(prompt) - 1`` tokens;
    - the hit blocks are taken out of the free queue; the request needs
      ``ceil(len(prompt) / block_size)`` blocks, the rest popped from the head of the free
      queue (a popped block that holds a cached chain is evicted);
    - the full blocks are cached under their chain (all tokens up to the block's end);
    - on finish, blocks are freed tail first: cached ones appended to the queue's tail (LRU),
      uncached ones (the partial block) prepended to its head.
    """

    def __init__(self, usable_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.queue = list(range(usable_blocks))
        self.chain_of: dict[int, tuple[int, ...]] = {}
        self.block_of: dict[tuple[int, ...], int] = {}
        self.rid_chains: dict[str, set[tuple[int, ...]]] = {}
        self.evicted_rids: list[str] = []

    def serve(self, tokens: list[int], rid: str) -> int:
        size = self.block_size
        hits: list[int] = []
        for i in range(max(len(tokens) - 1, 0) // size):
            block = self.block_of.get(tuple(tokens[: (i + 1) * size]))
            if block is None:
                break
            hits.append(block)
        for block in hits:
            if block in self.queue:
                self.queue.remove(block)
        need = -(-len(tokens) // size) - len(hits)
        assert need <= len(self.queue), "the test keeps every prompt within the pool"
        new, self.queue = self.queue[:need], self.queue[need:]
        for block in new:
            chain = self.chain_of.pop(block, None)
            if chain is not None:
                del self.block_of[chain]
                for other, chains in list(self.rid_chains.items()):
                    if chain in chains:
                        self.evicted_rids.append(other)
                        del self.rid_chains[other]
        blocks = hits + new
        chains = set()
        for i in range(len(tokens) // size):
            chain = tuple(tokens[: (i + 1) * size])
            chains.add(chain)
            if i >= len(hits):
                self.chain_of[blocks[i]] = chain
                self.block_of[chain] = blocks[i]
        if chains:
            self.rid_chains[rid] = chains
        freed = list(reversed(blocks))
        self.queue = (
            [b for b in freed if b not in self.chain_of]
            + self.queue
            + [b for b in freed if b in self.chain_of]
        )
        return len(hits) * size

    def used_tokens(self) -> int:
        return len(self.chain_of) * self.block_size


_tokens = st.integers(0, 3)  # a small alphabet, so that prompts share prefixes often


@settings(max_examples=300, deadline=None)
@given(
    stream=st.lists(st.lists(_tokens, min_size=0, max_size=14), min_size=1, max_size=30),
    block_size=st.integers(1, 4),
    spare_blocks=st.integers(0, 6),
)
def test_paged_model_matches_the_block_pool(
    stream: list[list[int]], block_size: int, spare_blocks: int
) -> None:
    longest = max(len(p) + 1 for p in stream)
    usable = -(-longest // block_size) + spare_blocks  # the pool must hold any one request
    model = PrefixCacheModel(usable * block_size, block_size=block_size, paged=True)
    reference = BlockPoolReference(usable, block_size)
    for step, prompt in enumerate(stream):
        # A prompt whose length is a multiple of the block size gets a token of its own: vLLM
        # then recomputes its last full block into a second copy (tested separately below).
        tokens = prompt + [100 + step] if len(prompt) % block_size == 0 else prompt
        rid = f"r{step}"
        assert model.serve(tokens, rid=rid) == reference.serve(tokens, rid), f"step {step}"
        assert model.stats().used_tokens == reference.used_tokens()
        assert sorted(model.take_evicted_rids()) == sorted(reference.evicted_rids)
        reference.evicted_rids.clear()


def test_eviction_trims_the_lru_leaf_block_by_block() -> None:
    # Block size 2, room for 4 blocks. A: blocks a1 a2 a3 (+ a partial block).
    model = PrefixCacheModel(8, block_size=2, paged=True)
    a = [1, 1, 2, 2, 3, 3, 9]
    assert model.serve(a, rid="a") == 0
    # B needs 2 blocks (one full, one partial) with 1 free: only a3, A's last block, goes.
    assert model.serve([5, 5, 6], rid="b") == 0
    assert model.take_evicted_rids() == ["a"]
    assert model.match_tokens(a) == 4  # a1 a2 kept
    assert model.serve(a, rid="a2") == 4
    # The node model (SGLang) would have dropped A's whole leaf.
    node = PrefixCacheModel(8, block_size=2)
    node.serve(a, rid="a")
    node.serve([5, 5, 6], rid="b")
    assert node.match_tokens(a) == 0


def test_partial_block_is_reserved_while_running_not_stored() -> None:
    model = PrefixCacheModel(6, block_size=2, paged=True)  # 3 blocks
    model.serve([1, 1, 2], rid="a")  # one full block stored, the partial one only reserved
    assert model.stats().used_tokens == 2
    # 2 blocks free: one full + one partial block fit without evicting.
    model.serve([3, 3, 4], rid="b")
    assert model.take_evicted_rids() == []
    assert model.stats().used_tokens == 4
    # 1 block free, 2 needed: the least recently used block (a's) goes, and only it.
    model.serve([5, 5, 6], rid="c")
    assert model.take_evicted_rids() == ["a"]
    assert model.match_tokens([3, 3, 4]) == 2


def test_last_token_rule_and_whole_blocks() -> None:
    model = PrefixCacheModel(None, block_size=4, paged=True)
    model.serve(list(range(8)))
    # Same 8 tokens: at most 7 may hit, so one whole block.
    assert model.serve(list(range(8))) == 4
    assert model.serve(list(range(9))) == 8
    assert model.serve(list(range(6)) + [99]) == 4
    assert model.stats().prompt_tokens == 8 + 8 + 9 + 7


def test_paged_capacity_is_whole_blocks_and_weights_are_refused() -> None:
    assert PrefixCacheModel(10, block_size=4, paged=True).capacity_tokens == 8
    model = PrefixCacheModel(None, block_size=2, paged=True)
    with pytest.raises(ValueError, match="weights must be None in paged mode"):
        model.serve([1, 2], [1, 1])
    with pytest.raises(TypeError, match="paged must be a bool"):
        PrefixCacheModel(None, paged=1)  # type: ignore[arg-type]
