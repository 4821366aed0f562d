"""An embedded model of an engine's prefix (KV) cache: a radix tree with LRU leaf eviction.

What it models (SGLang ``mem_cache/radix_cache.py``, RadixAttention, Zheng et al. 2024, §3):

* The cache is a radix tree over *units*. A unit is one token id when prompts are tokenized, or
  one rendered prompt segment (the system prompt, one context block, the tail) identified by
  its ``block_id`` and weighted by its token count. A node holds a run of units; a request's
  prompt is a path from the root.
* :meth:`PrefixCacheModel.serve` runs one request: it matches the longest cached prefix (a
  match that ends inside a node splits the node, as SGLang's ``match_prefix`` does), marks the
  matched nodes as used now, then inserts the rest of the prompt as a new leaf, evicting first
  if the capacity would be exceeded.
* Eviction is SGLang's: repeatedly remove the least-recently-used *leaf node* (whole node, all
  of its tokens) that the running request does not use; a parent whose last child went becomes
  a leaf and a candidate. Eviction stops once enough tokens are free (it may free more: whole
  nodes go). If even an empty cache could not hold the prompt, only the longest prefix that fits
  is inserted. Nodes are never merged back after an eviction (SGLang does not either).
* Reported hits follow the engines: the last prompt token is always recomputed (vLLM
  ``KVCacheManager.get_computed_blocks`` caps a hit at ``prompt_len - 1``; SGLang matches at most
  ``input_len - 1``), and with an engine block size ``B`` only whole blocks count (vLLM's
  ``usage.prompt_tokens_details.cached_tokens`` is a multiple of its block size; SGLang with
  ``page_size > 1`` likewise):
  ``cached = B * floor(min(matched_tokens, prompt_tokens - 1) / B)``.

Capacity is in tokens (the sum of unit weights held by the tree); ``None`` means unlimited.
Storage is counted per unit weight, not rounded up to blocks.

Paged mode (``paged=True``) models vLLM v1's block pool instead: see :class:`PrefixCacheModel`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["CacheStats", "PrefixCacheModel"]


class _Node:
    __slots__ = ("children", "key", "last_access", "parent", "rids", "tokens", "weights")

    def __init__(
        self,
        key: tuple[Hashable, ...],
        weights: tuple[int, ...],
        parent: _Node | None,
        last_access: int,
    ) -> None:
        self.key = key
        self.weights = weights
        self.tokens = sum(weights)
        self.parent = parent
        self.children: dict[Hashable, _Node] = {}
        self.last_access = last_access
        self.rids: list[str] = []


@dataclass
class CacheStats:
    """Counters of a :class:`PrefixCacheModel` (all token figures are in tokens).

    ``hit_ratio`` is ``cached_tokens / prompt_tokens`` over all served requests.
    """

    capacity_tokens: int | None
    block_size: int
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    used_tokens: int = 0
    peak_used_tokens: int = 0
    nodes: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    evicted_nodes: int = 0
    evicted_rids: int = 0
    truncated_inserts: int = 0
    hit_ratio: float = field(default=0.0)


class PrefixCacheModel:
    """Radix-tree prefix cache with a token capacity and LRU leaf eviction.

    Paged mode (``paged=True``) models vLLM v1's block pool instead
    (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``; checked against the real engine by
    ``tests/testbed/test_vllm_e2e.py``). Units are token ids, and the tree's units become whole
    *blocks* of ``block_size`` tokens:

    * only full blocks are cached (vLLM hashes full blocks only); a trailing partial block takes
      a block while the request runs and is free again right after (``free_blocks`` puts blocks
      without a hash at the front of the free queue, to be reused first);
    * capacity is in whole blocks (``capacity_tokens // block_size``; vLLM's pool has
      ``num_gpu_blocks - 1`` usable blocks, one being the reserved null block);
    * eviction frees single blocks, not whole nodes: a request allocates one block per block it
      lacks, and each allocation evicts the least recently freed cached block
      (``get_new_blocks`` pops the head of the free queue); a finished request's blocks are
      freed tail first (``free_blocks(reversed(...))``), so the least recently used leaf is
      trimmed from its end, and only as many blocks as are needed go.

    Hits follow the same formula as the radix mode (the last-token rule, whole blocks).

    Args:
        capacity_tokens: the most tokens the cache holds (``None``: unlimited).
        block_size: the engine's KV block (page) size in tokens; hits count in whole blocks.
        paged: model vLLM's paged block pool (above): units are token ids
            (``serve`` takes no weights), full blocks only, block-wise LRU eviction.

    Raises:
        ValueError: ``capacity_tokens < 0`` or ``block_size < 1``.
        TypeError: either is not an int, or ``paged`` is not a bool.

    Not thread-safe: one benchmark run drives one model.
    """

    def __init__(
        self, capacity_tokens: int | None, block_size: int = 1, *, paged: bool = False
    ) -> None:
        if capacity_tokens is not None:
            if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int):
                raise TypeError(f"capacity_tokens must be an int or None, got {capacity_tokens!r}")
            if capacity_tokens < 0:
                raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise TypeError(f"block_size must be an int, got {block_size!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not isinstance(paged, bool):
            raise TypeError(f"paged must be a bool, got {paged!r}")
        self.capacity_tokens = capacity_tokens
        self.block_size = block_size
        self.paged = paged
        if paged and capacity_tokens is not None:
            self.capacity_tokens = capacity_tokens - capacity_tokens % block_size
        self._clock = itertools.count(1)
        self._root = _Node((), (), None, 0)
        self._stats = CacheStats(capacity_tokens, block_size, nodes=0)
        self._pending_evicted_rids: list[str] = []

    # --- Public API -----------------------------------------------------------------------------

    def serve(
        self,
        units: Sequence[Hashable],
        weights: Sequence[int] | None = None,
        *,
        rid: str | None = None,
    ) -> int:
        """Run one request through the cache: match its prefix, then insert the prompt.

        Args:
            units: the prompt as units (token ids, or segment block ids), in prompt order.
            weights: tokens per unit (``None``: one token each), non-negative ints; must be
                ``None`` in paged mode.
            rid: the request id; it is reported by :meth:`take_evicted_rids` once the node where
                its cached prompt ends is evicted (paged mode: once any block of it is).

        Returns:
            cached tokens of this request (see the module docstring for the formula).

        Mutates: splits the node where the match ends, updates access times of matched nodes,
        evicts LRU leaves, inserts the unmatched rest.

        Raises:
            ValueError: ``weights`` has a different length than ``units`` or a negative weight,
                or weights are given in paged mode.
            TypeError: a weight is not an int.
        """
        units, weights, reserve, prompt_tokens = self._prompt_units(units, weights)
        now = next(self._clock)
        end, matched = self._match(units, now)
        matched_tokens = sum(weights[:matched])

        leaf = self._insert(end, units[matched:], weights[matched:], now, reserve=reserve)
        if rid is not None and leaf is not self._root:
            leaf.rids.append(rid)

        cached = min(matched_tokens, max(prompt_tokens - 1, 0))
        cached -= cached % self.block_size
        stats = self._stats
        stats.requests += 1
        stats.prompt_tokens += prompt_tokens
        stats.cached_tokens += cached
        return cached

    def match_tokens(self, units: Sequence[Hashable], weights: Sequence[int] | None = None) -> int:
        """Tokens of the longest cached prefix of ``units``, without changing the cache.

        Not capped and not rounded to blocks (compare :meth:`serve`); in paged mode only
        whole cached blocks count.
        """
        units, weights, _, _ = self._prompt_units(units, weights)
        node, pos = self._root, 0
        while pos < len(units):
            child = node.children.get(units[pos])
            if child is None:
                break
            common = _common_prefix(child.key, units, pos)
            pos += common
            if common < len(child.key):
                break
            node = child
        return sum(weights[:pos])

    def take_evicted_rids(self) -> list[str]:
        """Request ids whose cached prompt end was evicted since the last call (then cleared)."""
        rids, self._pending_evicted_rids = self._pending_evicted_rids, []
        return rids

    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        s = self._stats
        s.hit_ratio = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        return CacheStats(**vars(s))

    # --- Internals ------------------------------------------------------------------------------

    def _prompt_units(
        self, units: Sequence[Hashable], weights: Sequence[int] | None
    ) -> tuple[tuple[Hashable, ...], tuple[int, ...], int, int]:
        """(tree units, their weights, tokens reserved while the request runs, prompt tokens).

        Paged mode: the tree units are the full blocks (tuples of ``block_size`` token ids);
        a trailing partial block is reserved, not stored.
        """
        units = tuple(units)
        if not self.paged:
            weights = self._check_weights(units, weights)
            return units, weights, 0, sum(weights)
        if weights is not None:
            raise ValueError("weights must be None in paged mode (units are token ids)")
        size = self.block_size
        full = len(units) // size
        blocks = tuple(units[i * size : (i + 1) * size] for i in range(full))
        reserve = size if len(units) % size else 0
        return blocks, (size,) * full, reserve, len(units)

    @staticmethod
    def _check_weights(
        units: tuple[Hashable, ...], weights: Sequence[int] | None
    ) -> tuple[int, ...]:
        if weights is None:
            return (1,) * len(units)
        weights = tuple(weights)
        if len(weights) != len(units):
            raise ValueError(
                f"weights has {len(weights)} entries but units has {len(units)}; one per unit"
            )
        for i, w in enumerate(weights):
            if isinstance(w, bool) or not isinstance(w, int):
                raise TypeError(f"weights[{i}] must be an int, got {type(w).__name__}: {w!r}")
            if w < 0:
                raise ValueError(f"weights[{i}] must be >= 0, got {w}")
        return weights

    def _match(self, units: tuple[Hashable, ...], now: int) -> tuple[_Node, int]:
        """Descend along ``units``; return the node where the match ends and the matched units."""
        node, pos = self._root, 0
        while pos < len(units):
            child = node.children.get(units[pos])
            if child is None:
                break
            common = _common_prefix(child.key, units, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node = child
            pos += common
        return node, pos

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` units; return the new upper node (the lower keeps rids)."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:at], node.weights[:at], parent, node.last_access)
        parent.children[upper.key[0]] = upper
        node.key, node.weights = node.key[at:], node.weights[at:]
        node.tokens = sum(node.weights)
        node.parent = upper
        upper.children[node.key[0]] = node
        self._stats.nodes += 1
        return upper

    def _insert(
        self,
        parent: _Node,
        key: tuple[Hashable, ...],
        weights: tuple[int, ...],
        now: int,
        *,
        reserve: int = 0,
    ) -> _Node:
        """Add ``key`` as a new leaf under ``parent``, evicting to make room; return its end.

        ``reserve`` tokens must be free too while the request runs, but are not stored (paged
        mode: the trailing partial block).
        """
        stats = self._stats
        if not key:
            if reserve and self.capacity_tokens is not None:
                overflow = stats.used_tokens + reserve - self.capacity_tokens
                if overflow > 0:
                    self._evict(overflow, protect=parent)
            return parent
        need = sum(weights)
        if self.capacity_tokens is not None:
            overflow = stats.used_tokens + need + reserve - self.capacity_tokens
            if overflow > 0:
                self._evict(overflow, protect=parent)
            free = self.capacity_tokens - stats.used_tokens - reserve
            if need > free:
                stats.truncated_inserts += 1
                keep = 0
                total = 0
                for w in weights:
                    if total + w > free:
                        break
                    total += w
                    keep += 1
                key, weights, need = key[:keep], weights[:keep], total
                if not key:
                    return parent
        leaf = _Node(key, weights, parent, now)
        parent.children[key[0]] = leaf
        stats.nodes += 1
        stats.used_tokens += need
        stats.inserted_tokens += need
        stats.peak_used_tokens = max(stats.peak_used_tokens, stats.used_tokens)
        return leaf

    def _evict(self, num_tokens: int, *, protect: _Node) -> None:
        """Free at least ``num_tokens`` tokens by removing LRU leaves (whole nodes).

        ``protect`` (the node where the running request's match ends) and so its ancestors stay.
        Access times of leaves are distinct (one request touches one root path), so the order
        does not depend on tie-breaking. Paged mode: the last leaf taken is trimmed from its
        end to free only what is still needed.
        """
        heap = [
            (leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf is not protect
        ]
        heapq.heapify(heap)
        stats = self._stats
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            if self.paged and leaf.tokens > num_tokens - freed:
                freed += self._trim(leaf, num_tokens - freed)
                break
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += leaf.tokens
            stats.used_tokens -= leaf.tokens
            stats.evicted_tokens += leaf.tokens
            stats.evicted_nodes += 1
            stats.nodes -= 1
            stats.evicted_rids += len(leaf.rids)
            self._pending_evicted_rids.extend(leaf.rids)
            if parent is not self._root and not parent.children and parent is not protect:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _trim(self, leaf: _Node, num_tokens: int) -> int:
        """Drop units from the end of ``leaf`` until ``num_tokens`` are freed (paged mode:
        the leaf keeps at least one unit); its rids lose their cached end. Returns tokens freed."""
        keep, dropped = len(leaf.key), 0
        while dropped < num_tokens:
            keep -= 1
            dropped += leaf.weights[keep]
        leaf.key, leaf.weights = leaf.key[:keep], leaf.weights[:keep]
        leaf.tokens -= dropped
        stats = self._stats
        stats.used_tokens -= dropped
        stats.evicted_tokens += dropped
        stats.evicted_rids += len(leaf.rids)
        self._pending_evicted_rids.extend(leaf.rids)
        leaf.rids = []
        return dropped

    def _leaves(self) -> list[_Node]:
        leaves = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves


def _common_prefix(key: tuple[Hashable, ...], units: tuple[Hashable, ...], pos: int) -> int:
    """Length of the common prefix of ``key`` and ``units[pos:]``."""
    n = min(len(key), len(units) - pos)
    if key[:n] == units[pos : pos + n]:
        return n
    i = 0
    while i < n and key[i] == units[pos + i]:
        i += 1
    return i
