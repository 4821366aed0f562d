"""Recency-weighted popularity of blocks, remembered after the engine evicts them.

The online rest order (:mod:`.alignment`, ``rest_order="popularity"``) puts blocks likely to be
retrieved again early, so later requests can share a longer prefix. A block's score gains 1
each time a planned request holds it and halves every ``half_life`` planned requests, so blocks
that keep being retrieved stay ahead of blocks that were popular once. Measured in
``benchmarks/micro/bench_ordering.py``: a half-life of 30 requests beat both no memory and
unbounded counts on MultiHop-RAG and MTRAG online.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from contextpilot_integrations.core.lru import LRU

_NO_REQUESTS: frozenset[int] = frozenset()

__all__ = ["CooccurrenceMemory", "PopularityMemory"]


class PopularityMemory:
    """Decayed request counts per block id.

    Args:
        capacity: blocks remembered (least recently seen dropped first); 0 remembers nothing.
        half_life: planned requests after which a score halves.

    Scores are kept in growing units (each occurrence adds ``2 ** (t / half_life)`` for its
    request number ``t``, and a read divides by the current unit), so ``add`` costs one power
    per request, not one per block; the units are rebased before they overflow. ``O(k)`` for
    ``k`` blocks; thread-safe.
    """

    _REBASE_AT = 1e150  # a unit this large is folded back into the scores

    def __init__(self, capacity: int, half_life: float = 30.0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"popularity_memory must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.half_life = half_life
        self._clock = 0
        self._base = 0  # request number at which the unit is 1
        self._unit = 1.0  # 2 ** ((clock - base) / half_life)
        self._scores: LRU[int, float] = LRU(max(capacity, 1))
        self._lock = threading.Lock()

    def add(self, blocks: Sequence[int]) -> None:
        """One more planned request holds ``blocks``."""
        if self.capacity == 0:
            return
        with self._lock:
            self._clock += 1
            self._unit = 2.0 ** ((self._clock - self._base) / self.half_life)
            if self._unit > self._REBASE_AT:
                self._rebase()
            unit, scores = self._unit, self._scores
            scores.put_many((block, scores.peek(block, 0.0) + unit) for block in blocks)

    def get(self, block: int) -> float:
        """The block's decayed score (0.0 when not remembered)."""
        return self._scores.peek(block, 0.0) / self._unit

    def _rebase(self) -> None:
        unit = self._unit
        self._scores.map_values(lambda score: score / unit)
        self._base, self._unit = self._clock, 1.0


class CooccurrenceMemory:
    """Which recent requests held each block: the co-occurrence the online rest order reads.

    A later request can share a prompt prefix only with a request that holds all of that
    prefix's blocks, so the block most worth placing next is the one the most recent requests
    holding the prefix so far also held (a conditional frequency, the online counterpart of
    the frequency tree of :mod:`.clustering`). The memory keeps, for the last ``horizon``
    planned requests, each block's set of request numbers.

    Args:
        horizon: recent requests remembered (>= 0; 0 remembers nothing).

    ``add`` costs ``O(k)``; thread-safe.
    """

    def __init__(self, horizon: int) -> None:
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 0:
            raise ValueError(f"cooccurrence_memory must be an int >= 0, got {horizon!r}")
        self.horizon = horizon
        self._lock = threading.Lock()
        self._clock = 0
        self._requests: LRU[int, tuple[int, ...]] = LRU(max(horizon, 1))
        self._holders: dict[int, set[int]] = {}

    def add(self, blocks: Sequence[int]) -> None:
        """One more planned request holds ``blocks``."""
        if self.horizon == 0:
            return
        with self._lock:
            self._clock += 1
            number = self._clock
            held = tuple(blocks)
            for block in held:
                self._holders.setdefault(block, set()).add(number)
            for old, old_blocks in self._requests.put(number, held):
                for block in old_blocks:
                    holders = self._holders.get(block)
                    if holders is not None:
                        holders.discard(old)
                        if not holders:
                            del self._holders[block]

    def __len__(self) -> int:
        """Recent requests remembered."""
        return len(self._requests)

    def future_reuse(
        self, blocks: Sequence[int], tokens: Sequence[int], lifetime: int, depth: int
    ) -> float:
        """Tokens a prompt starting with ``blocks`` can expect later requests to reuse: for each
        leading prefix, its tokens times the chance that one of the next ``lifetime`` requests
        holds it all (each recent request held it with the frequency seen here)."""
        remembered = len(self._requests)
        if remembered == 0 or lifetime <= 0:
            return 0.0
        together: set[int] | frozenset[int] | None = None
        value = 0.0
        for block, count in zip(blocks[:depth], tokens[:depth]):
            held = self.holders(block)
            together = held if together is None else together & held
            if not together:
                break
            frequency = len(together) / remembered
            value += count * (1.0 - (1.0 - frequency) ** lifetime)
        return value

    def holders(self, block: int) -> frozenset[int] | set[int]:
        """The recent requests holding ``block`` (do not change the returned set)."""
        return self._holders.get(block, _NO_REQUESTS)
