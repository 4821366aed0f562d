"""The context index: a radix tree of block-id sequences that mirrors the engine's prefix cache.

ContextPilot paper (MLSys 2026), section 4 (context index). A node holds a run of block ids
(its edge); the path from the root to a node is a prefix every context below it starts with; a
context ends at a node that records its request id (``rid``). The tree is kept compressed (a
node with one child and no request of its own is merged into that child). Costs (``k`` = blocks
in the request, ``h`` = tree height <= k):

* :meth:`ContextIndex.search` -- every child whose edge starts with a request block is explored
  (depth first, at most ``search_budget`` nodes; the paper's Algorithm 1 takes one child per
  level) and the prefix with the most request tokens wins. ``O(budget * k)``; read-only.
* :meth:`ContextIndex.insert` -- append a context under the node where its prefix ends, or
  split an edge so the shared prefix gets its own node. ``O(k)``.
* :meth:`ContextIndex.evict` -- remove one request; prune and re-compress. ``O(h)``.

Search paths are never stored (:meth:`search_path` walks parent links), so a path is always
right after removals and splits. Node ids start at 1 and are never reused. The tree's nodes and
surgery: :mod:`.index_tree`; this module keys requests to its nodes and keeps the bounds, the
lock and the statistics.

Bounded (docs/DESIGN.md, "Bounded"): with ``max_requests`` and/or ``max_tokens`` set, inserting
past the bound evicts least-recently-used requests. Every public method takes one re-entrant
lock, so one index can be shared by threads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contextpilot_integrations.core.index.index_snapshot import (
    INDEX_SNAPSHOT_VERSION,
    checked_entries,
)
from contextpilot_integrations.core.index.index_tree import (
    IndexNode,
    IndexTree,
    common_prefix,
    path_of,
)
from contextpilot_integrations.core.index.index_types import IndexStats, SearchResult
from contextpilot_integrations.core.lru import LRU

__all__ = ["ContextIndex"]


@dataclass(slots=True)
class _Request:
    node: IndexNode
    blocks: tuple[int, ...]
    tokens: tuple[int, ...]


class ContextIndex:
    """Radix tree of context-block sequences keyed by request id.

    Args:
        max_requests: most requests kept; inserting more evicts the least recently used.
            ``None`` = unbounded (only for engines that report evictions).
        max_tokens: most block tokens kept in the tree (sum over nodes of their edge tokens,
            i.e. what the prefix cache would hold); ``None`` = no token bound.
        on_evict: called with each rid the index drops by itself (LRU), outside no lock
            guarantees: it runs under the index lock and must not call back into the index.
        clock: time source in seconds (tests inject one).
        search_budget: most nodes one :meth:`search` expands (bounds the hot path).

    Raises:
        ValueError: a bound that is not a positive integer.
    """

    def __init__(
        self,
        *,
        max_requests: int | None = 100_000,
        max_tokens: int | None = None,
        on_evict: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        search_budget: int = 256,
    ) -> None:
        for name, value in (("max_requests", max_requests), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._on_evict = on_evict
        if not isinstance(search_budget, int) or search_budget < 1:
            raise ValueError(f"search_budget must be an int >= 1, got {search_budget!r}")
        self.search_budget = search_budget
        self._clock = clock
        self._lock = threading.RLock()
        self._tree = IndexTree()
        # LRU order, oldest first; the bounds are applied by _enforce_bounds (tree surgery).
        self._requests: LRU[str, _Request] = LRU()
        self._block_requests: Counter[int] = Counter()  # live requests holding each block
        self._inserts = 0
        self._evictions = 0
        self._lru_evictions = 0
        self._searches = 0
        self._searched_tokens = 0
        self._matched_tokens = 0

    # ------------------------------------------------------------------ Public API: lookups
    def search(self, blocks: Sequence[int], tokens: Sequence[int] | None = None) -> SearchResult:
        """Find the indexed prefix made only of ``blocks`` that holds the most of their tokens.

        A depth-first search from the root that enters only children whose first block is in
        the request, and stops inside an edge at the first block not in the request. The
        paper's Algorithm 1 descends greedily to one child per level; exploring every
        matching branch finds longer prefixes when the greedy choice is a short edge over a
        deep subtree. Equal gains prefer a match that ends on a node boundary (no split). The
        search visits at most ``search_budget`` nodes, each costing
        ``O(k)`` look-ups, so it never depends on the size of the index. Ties go to the most
        recently used node (the likeliest to still be cached), then the oldest node id.

        Args:
            blocks: the request's block ids (any order; no repeats).
            tokens: tokens per block, same length; ``None`` counts each block as 1.

        Returns:
            :class:`SearchResult`. Does not mutate the tree (statistics only).

        Raises:
            ValueError: ``tokens`` of another length than ``blocks``, or a repeated block.
        """
        return self.search_weights(_weights(blocks, tokens))

    def search_weights(self, weight: Mapping[int, int]) -> SearchResult:
        """:meth:`search` for a request given as its block -> tokens map, the blocks in the
        request's order: a planner that keeps this map for the rest of the plan builds it once
        (docs/DESIGN.md, "Hot path"). A map holds each block once."""
        with self._lock:
            matched, prefix, path, split = self._tree.best_prefix(weight, self.search_budget)
            self._searches += 1
            self._searched_tokens += sum(weight.values())
            self._matched_tokens += matched
            return SearchResult(prefix, matched, path, path[-1] if path else 0, split)

    def search_path(self, rid: str) -> tuple[int, ...]:
        """Node ids from the root's child down to the node where ``rid``'s context ends.

        Raises:
            KeyError: ``rid`` is not indexed.
        """
        with self._lock:
            return path_of(self._request(rid).node)

    def prefix_in_order(self, blocks: Sequence[int], tokens: Sequence[int]) -> tuple[int, int]:
        """The longest indexed prefix of ``blocks`` taken in exactly this order (what a prompt in
        this order would hit if the index is right): ``(blocks, tokens)`` of it.
        ``O(len(blocks))``, read-only.

        Raises:
            ValueError: ``tokens`` of another length than ``blocks``.
        """
        if len(tokens) != len(blocks):
            raise ValueError(f"tokens has {len(tokens)} entries for {len(blocks)} blocks")
        with self._lock:
            return self._tree.prefix_in_order(blocks, tokens)

    def search_paths(self, rids: Sequence[str]) -> list[tuple[int, ...]]:
        """:meth:`search_path` of each rid, read in one step; ``()`` for a rid not indexed
        (evicted meanwhile), so a batch's schedule never races an eviction."""
        with self._lock:
            requests = self._requests
            paths = []
            for rid in rids:
                request = requests.peek(rid)
                paths.append(path_of(request.node) if request is not None else ())
            return paths

    def shared_prefixes(self, rids: Sequence[str]) -> list[tuple[int, int]]:
        """For each rid, ``(blocks, tokens)`` of the longest prefix of its context that another
        indexed request also starts with (``(0, 0)`` for a rid not indexed), read in one step.

        ``O(height)`` per rid (:meth:`.IndexTree.shared_prefix`).
        """
        with self._lock:
            out = []
            for rid in rids:
                request = self._requests.peek(rid)
                if request is None:
                    out.append((0, 0))
                    continue
                out.append(self._tree.shared_prefix(request.node))
            return out

    def __contains__(self, rid: object) -> bool:
        with self._lock:
            return rid in self._requests

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def context(self, rid: str) -> tuple[int, ...]:
        """The block ids of ``rid``'s context in index (prompt) order. Raises KeyError."""
        with self._lock:
            return self._request(rid).blocks

    def block_popularity(self, block: int) -> int:
        """How many indexed requests hold ``block`` (0 if none)."""
        with self._lock:
            return self._block_requests.get(block, 0)

    def block_popularities(self, blocks: Sequence[int]) -> list[int]:
        """:meth:`block_popularity` of each of ``blocks``, read in one step."""
        with self._lock:
            get = self._block_requests.get
            return [get(block, 0) for block in blocks]

    def rids(self) -> list[str]:
        """Indexed request ids, least recently used first."""
        with self._lock:
            return list(self._requests)

    # ------------------------------------------------------------------ Public API: mutations
    def insert(self, rid: str, blocks: Sequence[int], tokens: Sequence[int] | None = None) -> int:
        """Index ``rid``'s context in the given (prompt) order.

        Mutates the tree: may split one node (the shared part of its edge becomes a new
        parent node) and adds at most one leaf. Then applies the size bounds, which may evict
        other least-recently-used requests (never ``rid`` itself).

        Args:
            rid: request id, unique among indexed requests.
            blocks: block ids in prompt order; non-empty, no repeats.
            tokens: tokens per block (``None`` = 1 each), used for the token bound and stats.

        Returns:
            The id of the node where the context ends.

        Raises:
            ValueError: empty ``blocks``, a repeated block, mismatched ``tokens``, an empty or
                non-string ``rid``, or ``rid`` already indexed.
        """
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid must be a non-empty str, got {rid!r}")
        weight = _weights(blocks, tokens)
        if not weight:
            raise ValueError(f"cannot index an empty context (rid={rid!r})")
        seq = tuple(blocks)
        toks = tuple(weight.values())  # in block order: no block repeats
        with self._lock:
            if rid in self._requests:
                raise ValueError(f"rid {rid!r} is already indexed")
            now = self._clock()
            node = self._tree.root
            i = 0
            while i < len(seq):
                child = node.children.get(seq[i])
                if child is None:
                    leaf = self._tree.add_leaf(seq[i:], toks[i:], node)
                    node = leaf
                    i = len(seq)
                    break
                # An edge of one block (most are) matches its first block, its key.
                common = 1 if len(child.blocks) == 1 else common_prefix(child.blocks, seq, i)
                if common < len(child.blocks):
                    child = self._tree.split(child, common)
                child.access_count += 1
                child.last_access = now
                node = child
                i += common
            node.rids.add(rid)
            node.access_count += 1
            node.last_access = now
            self._requests.put(rid, _Request(node, seq, toks))
            self._block_requests.update(seq)  # one counting loop in C
            self._inserts += 1
            self._enforce_bounds(keep=rid)
            return node.node_id

    def touch(self, rid: str) -> bool:
        """Mark ``rid`` as just used (LRU order, access counts along its path).

        Returns:
            False when ``rid`` is not indexed.
        """
        with self._lock:
            request = self._requests.get(rid)  # marks it used
            if request is None:
                return False
            now = self._clock()
            node: IndexNode | None = request.node
            while node is not None and node is not self._tree.root:
                node.access_count += 1
                node.last_access = now
                node = node.parent
            return True

    def evict(self, rid: str) -> bool:
        """Remove ``rid``'s context; prune nodes left with no request and no child.

        Mutates the tree in ``O(height)``: removes the request's node if it became empty,
        then empty parents, and merges a parent left with a single child and no request.

        Returns:
            False when ``rid`` is not indexed (evicting twice is harmless).

        Raises:
            TypeError: ``rid`` is not a str.
        """
        if not isinstance(rid, str):
            raise TypeError(f"rid must be a str, got {type(rid).__name__}: {rid!r:.80}")
        with self._lock:
            return self._evict(rid)

    def evict_many(self, rids: Iterable[str]) -> int:
        """Evict each rid; returns how many were indexed."""
        with self._lock:
            return sum(self._evict(rid) for rid in rids)

    def clear(self) -> int:
        """Drop every request (an engine's ``AllBlocksCleared``). Returns how many."""
        with self._lock:
            count = len(self._requests)
            self._tree.clear()
            self._requests.clear()
            self._block_requests.clear()
            self._evictions += count
            return count

    # ------------------------------------------------------------------ Public API: state
    def stats(self) -> IndexStats:
        """Counters and sizes: requests, nodes (root excluded), tokens held, height, ..."""
        with self._lock:
            height = max((len(path_of(r.node)) for r in self._requests.values()), default=0)
            return IndexStats(
                requests=len(self._requests),
                nodes=len(self._tree.nodes) - 1,
                tokens=self._tree.tokens,
                height=height,
                inserts=self._inserts,
                evictions=self._evictions,
                lru_evictions=self._lru_evictions,
                searches=self._searches,
                searched_tokens=self._searched_tokens,
                matched_tokens=self._matched_tokens,
            )

    def snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable copy of the indexed contexts, least recently used first.

        The tree is rebuilt from the contexts on :meth:`restore`; node ids are not kept. The lock
        is held only to copy the request list, a few thousand entries at a time (a request's
        blocks and tokens never change), so planning is not held up while a large index is
        copied and formatted. A request inserted meanwhile may be missed and one evicted
        meanwhile is left out: the copy is a checkpoint, not an atomic view.
        """
        with self._lock:
            rids = list(self._requests)
        held: list[tuple[str, _Request]] = []
        for start in range(0, len(rids), _SNAPSHOT_CHUNK):
            with self._lock:
                for rid in rids[start : start + _SNAPSHOT_CHUNK]:
                    request = self._requests.peek(rid)
                    if request is not None:
                        held.append((rid, request))
        return {
            "version": INDEX_SNAPSHOT_VERSION,
            "requests": [
                {"rid": rid, "blocks": [str(b) for b in r.blocks], "tokens": list(r.tokens)}
                for rid, r in held
            ],
        }

    @classmethod
    def restore(cls, snapshot: object, **kwargs: Any) -> ContextIndex:
        """A new index (``kwargs`` as for the constructor) loaded with :meth:`snapshot` output.

        Raises:
            ValueError: as :meth:`load`.
        """
        index = cls(**kwargs)
        index.load(snapshot)
        return index

    def load(self, snapshot: object) -> int:
        """Replace the indexed contexts with :meth:`snapshot` output (same LRU order; the bounds
        apply as the entries are inserted); returns how many are indexed.

        Every entry is checked (a str rid of at most 512 characters, block ids in
        ``0..2**64-1`` as decimal strings, token counts ``0..2**32``, no repeated block) before
        anything is loaded.

        Raises:
            ValueError: an unknown version or a malformed entry (the index is left unchanged).
        """
        entries = checked_entries(snapshot)
        with self._lock:
            self.clear()
            for rid, blocks, tokens in entries:
                if rid not in self._requests:
                    self.insert(rid, blocks, tokens)
            return len(self._requests)

    # ------------------------------------------------------------------ internals
    def _request(self, rid: str) -> _Request:
        request = self._requests.peek(rid)
        if request is None:
            raise KeyError(f"rid {rid!r} is not indexed")
        return request

    def _evict(self, rid: str, *, by_lru: bool = False) -> bool:
        request = self._requests.pop(rid, None)
        if request is None:
            return False
        for block in request.blocks:
            left = self._block_requests[block] - 1
            if left:
                self._block_requests[block] = left
            else:
                del self._block_requests[block]
        request.node.rids.discard(rid)
        merged = self._tree.prune(request.node)
        if merged is not None:
            for other in merged.rids:  # their contexts now end at the merged node
                held = self._requests.peek(other)
                assert held is not None
                held.node = merged
        self._evictions += 1
        if by_lru:
            self._lru_evictions += 1
        return True

    def _enforce_bounds(self, keep: str) -> None:
        max_requests, max_tokens = self.max_requests, self.max_tokens
        while len(self._requests) > 1 and (
            (max_requests is not None and len(self._requests) > max_requests)
            or (max_tokens is not None and self._tree.tokens > max_tokens)
        ):
            entry = self._requests.oldest()
            assert entry is not None
            oldest = entry[0]
            if oldest == keep:  # only when ``keep`` was touched back to the front
                self._requests.touch(keep)
                entry = self._requests.oldest()
                assert entry is not None
                oldest = entry[0]
            self._evict(oldest, by_lru=True)
            if self._on_evict is not None:
                self._on_evict(oldest)


_SNAPSHOT_CHUNK = 4096  # requests copied per hold of the lock by snapshot()


def _weights(blocks: Sequence[int], tokens: Sequence[int] | None) -> dict[int, int]:
    if tokens is not None and len(tokens) != len(blocks):
        raise ValueError(f"tokens has {len(tokens)} entries for {len(blocks)} blocks")
    weight = dict(zip(blocks, tokens)) if tokens is not None else dict.fromkeys(blocks, 1)
    if len(weight) != len(blocks):
        seen: set[int] = set()
        repeated = next(b for b in blocks if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise ValueError(f"block id {repeated} appears twice in one context")
    return weight
